"""`zenflow estimate` reads as an answer: what to use and why first (the window, the step time
against ZeRO-Offload and against the floor, device and host memory), the tables after, and no
line that contradicts another. What it says is checked against the estimate's own numbers."""
import re

import pytest
import torch

from zenflow.optim.windows import WINDOW_BUDGET
from zenflow.tools.cli import main
from zenflow.tools.estimate import GIB, SAMPLE_FWD_BWD_S, estimate
from zenflow.tools.estimate_answer import gib, num, secs, verdict
from zenflow.tools.estimate_host import HostMachine, host_figures
from zenflow.tools.estimate_report import format_report
from zenflow.tools.estimate_shapes import llama_shapes

LLAMA2_7B = llama_shapes(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32)
# benchmarks/estimate_llama2_7b.py's 1xH100 on a 2-socket server
H100 = dict(host_adamw_params_per_s=5.2e9, host_accumulate_params_per_s=2e10,
            host_factored_params_per_s=5.2e9,   # enough cores for "factored" to reach bandwidth
            device_adamw_params_per_s=1.2e11, device_norm_bytes_per_s=2.5e12,
            device_copy_bytes_per_s=1.5e12, d2h_bytes_per_s=5e10, h2d_bytes_per_s=5e10,
            available_host_bytes=512 * GIB)


def _answer(text: str) -> str:
    """The answer: from its first line to the details."""
    return text[text.index("Answer:"):text.index("\nDetails")]


def test_without_a_step_time_it_says_what_it_assumed_and_what_to_pass():
    """Llama-2-7B on one GPU, no --fwd-bwd-seconds: no window of 1 beside a 6.7 s host update;
    the windows and step times at a few forward+backward times instead, each what the estimate
    gives with that time, and the figures it assumed."""
    r = estimate(LLAMA2_7B, torch.bfloat16, measured={"available_host_bytes": 512 * GIB})
    text = format_report(r)
    answer = _answer(text)
    assert text.index("Answer:") < text.index("Per GPU") < text.index("Bus per GPU")
    assert "--fwd-bwd-seconds" in answer and "not modelled without your step time" in answer
    # the host's figures follow from the server the estimate assumes (estimate_host.py); the
    # window's update is "factored"'s where its matrices are
    factored = r["per_gpu"]["credit_rule"] == "factored" and r["per_gpu"]["moments_matrices"]
    key = "host_factored_params_per_s" if factored else "host_adamw_params_per_s"
    rate = num(host_figures(HostMachine(), 1)[key][0])
    assert rate == num(r["figures"][key]) == ("7.4e9" if factored else "8.3e9")
    said = f'the "factored" update at {rate}' if factored else f"host AdamW at {rate}"
    flat = " ".join(answer.split())   # unwrapped
    assert f"{secs(r['seconds']['adamw_s'])} here, {said} params/s, assumed" in flat
    assert "ASSUMED" in answer and "--selftest-json" in answer
    assert "update_interval 1" not in text and "expected auto window" not in text
    assert "update_interval auto (the window needs --fwd-bwd-seconds)" in text
    # ZenFlow's bytes a step are not printed for a window nobody knows
    assert re.search(r"device->host per step +\d+\.\d+ GiB +per window / U", text)
    assert not r["settings"]["window_known"]
    for fwd, row in zip(SAMPLE_FWD_BWD_S, r["by_step_time"]):
        given = estimate(LLAMA2_7B, torch.bfloat16, fwd_bwd_s=fwd,
                         measured={"available_host_bytes": 512 * GIB})
        assert row["window"] == given["settings"]["update_interval"]
        assert row["zenflow_step_s"] == given["time"]["zenflow_step_s"]
        line = (f"{secs(fwd):>8} {row['window']:>7} {secs(row['zenflow_step_s']):>13} "
                f"{secs(row['offload_step_s']):>13} {secs(row['adamw_step_s']):>12}")
        assert line in answer, line


def test_with_a_step_time_it_recommends_and_gives_the_reasons():
    """Llama-2-7B on one H100 (the benchmark's figures), forward+backward 0.5 s: the verdict,
    then the window and why, the step against ZeRO-Offload and the floor, both memories and the
    bus, each number the estimate's own."""
    r = estimate(LLAMA2_7B, torch.bfloat16, fwd_bwd_s=0.5, measured=H100)
    tm, s, g, h = r["time"], r["settings"], r["per_gpu"], r["per_host"]
    text = format_report(r)
    answer = _answer(text)
    U = s["update_interval"]
    assert tm["zenflow_step_s"] < tm["offload_step_s"]
    assert answer.startswith(f"Answer: Use ZenFlowAdamW: {secs(tm['zenflow_step_s'])} a step")
    flat = " ".join(answer.split())   # unwrapped
    assert f"{tm['speedup_vs_offload']:.1f}x faster than ZeRO-Offload" in flat
    assert f"{tm['zenflow_vs_floor']:.2f}x the AdamW floor ({secs(tm['adamw_step_s'])})" in flat
    assert f"update_interval 'auto' settles at {U} step(s)" in flat
    assert (f"needs {tm['min_update_interval_hiding_host']} step(s) of "
            f"{secs(tm['zenflow_T_dev_s'])} to hide" in flat)
    assert (f"{tm['update_interval_for_install_budget']} to stay within "
            f"{round(100 * WINDOW_BUDGET)}% of the time") in flat
    assert U == max(tm["min_update_interval_hiding_host"],
                    tm["update_interval_for_install_budget"])
    assert f"Quality cost at {U} step(s): about {r['quality']['held_out_loss_gap_pct']:+.1f}%" in flat
    assert f"ZenFlowAdamW {gib(g['left_for_activations_bytes']['zenflow'])}" in flat
    assert "AdamW with fp32 master weights does NOT fit" in flat
    assert (f"ZenFlowAdamW {gib(h['zenflow']['arena_bytes'])} of RAM" in flat
            and f"{gib(h['zenflow']['pinned_bytes'])} of it page-locked" in flat)
    assert "The selftest's machine has 512.0 GiB available: it fits." in flat
    assert (f"reselection: the device waits about {secs(r['seconds']['reselect_s'])} "
            f"({r['seconds']['reselect_s'] / tm['zenflow_step_s']:.1f} steps) for one") in flat
    # the details say the same window
    assert f"update_interval {U} (expected auto window)" in text


def test_a_window_given_too_short_says_what_the_step_waits():
    # (one step: the host's update of a window needs two here, now that the widening of bf16
    # sums is counted inside it rather than as a pass of its own)
    r = estimate(LLAMA2_7B, torch.bfloat16, fwd_bwd_s=0.5, measured=H100, update_interval=1,
                 deferred_credit="moments")
    flat = " ".join(_answer(format_report(r)).split())
    assert r["time"]["min_update_interval_hiding_host"] > 1
    assert "update_interval, as given: 1 step(s)" in flat
    assert f"at 1 the step waits {secs(r['time']['zenflow_stall_s'])} for them" in flat


@pytest.mark.parametrize("shapes, memory, says", [
    ([("w", (1024, 1024))] * 8, 80, "No offload needed"),
    (LLAMA2_7B, 24, "ZenFlowAdamW does not fit on one GPU of 24.0 GiB"),
])
def test_the_verdict_follows_what_fits(shapes, memory, says):
    r = estimate(shapes, torch.bfloat16, gpu_memory_bytes=memory * GIB, fwd_bwd_s=0.5,
                 measured=H100)
    assert verdict(r).startswith(says)
    if memory == 24:
        assert "--fsdp N" in verdict(r)


def test_the_verdict_says_when_the_host_is_short_and_when_zero_offload_is_as_fast():
    r = estimate(LLAMA2_7B, torch.bfloat16, fwd_bwd_s=0.5,
                 measured={**H100, "available_host_bytes": 64 * GIB})
    assert not r["per_host"]["fits"]["zenflow"]
    assert (f"It needs {gib(r['per_host']['zenflow']['arena_bytes'])} of host RAM: more than "
            "the selftest's machine has") in verdict(r)
    r["time"]["zenflow_step_s"] = r["time"]["offload_step_s"] + 1
    assert verdict(r).startswith("ZeRO-Offload (OffloadAdamW) is as fast here")


def test_the_command_prints_the_answer_first(capsys):
    assert main(["estimate", "--shapes", "4096x4096*8,4096*8"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0].startswith("Model:") and lines[1].startswith("Answer:")


def test_a_window_given_without_a_step_time_is_stated_with_the_step_times_by_fwd_bwd():
    r = estimate(LLAMA2_7B, torch.bfloat16, update_interval=4, measured=H100)
    answer = _answer(format_report(r))
    assert "window: 4 step(s) (as given); step time: not modelled" in " ".join(answer.split())
    assert [row["window"] for row in r["by_step_time"]] == [4] * len(SAMPLE_FWD_BWD_S)
    for row in r["by_step_time"]:
        assert f"{secs(row['fwd_bwd_s']):>8} {4:>7} {secs(row['zenflow_step_s']):>13}" in answer


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "0"], "argument --gpus: must be an integer >= 1, got '0'"),
    (["--fsdp", "0"], "argument --fsdp: must be an integer >= 1, got '0'"),
    (["--topk-ratio", "2"], "argument --topk-ratio: must be a number in [0, 1], got '2'"),
    (["--fwd-bwd-seconds", "-1"], "argument --fwd-bwd-seconds: must be a number > 0, got '-1'"),
    (["--gpu-memory", "0"], "argument --gpu-memory: must be a number > 0, got '0'"),
    (["--activation-gib", "-1"], "argument --activation-gib: must be a number >= 0, got '-1'"),
    (["--update-interval", "x"],
     "argument --update-interval: must be \"auto\" or an integer >= 1, got 'x'"),
])
def test_a_bad_argument_is_refused_naming_it_and_its_value(argv, says, capsys):
    """Each was taken before (--gpus 0 as 1 GPU, a negative step time or memory as given)."""
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--shapes", "64x64", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_a_broken_selftest_json_is_named_with_its_argument(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    for text, says in (("not json", "Expecting value"), ("[1]", "not a `zenflow selftest")):
        path.write_text(text)
        assert main(["estimate", "--shapes", "64x64", "--selftest-json", str(path)]) == 2
        assert f"--selftest-json {path}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("gpus", 0), ("topk_ratio", 1.5), ("fwd_bwd_s", 0.0),
                                         ("update_interval", 0), ("target", "gpu"),
                                         ("deferred_credit", "sum"), ("device_sum_budget", -1),
                                         ("device_sum_dtype", "float16"),
                                         ("gpu_memory_bytes", -1), ("activation_bytes", -1)])
def test_estimate_refuses_an_argument_out_of_range_naming_it(name, value):
    with pytest.raises(ValueError, match=f"estimate\\(\\): {name} must be .*, got {value!r}"):
        estimate([("w", (64, 64))], **{name: value})


def test_no_reselection_is_spoken_of_where_no_column_can_move():
    for ratio in (0.0, 1.0):
        r = estimate(LLAMA2_7B, torch.bfloat16, fwd_bwd_s=0.5, measured=H100, topk_ratio=ratio)
        assert "reselection:" not in _answer(format_report(r))
