"""`zenflow bench` end to end on a tiny model: rounds of child processes, JSON and PNG output."""
import json
import struct

import pytest
import torch

from zenflow.tools.bench import cli, harness
from zenflow.tools.bench import systems as systems_module
from zenflow.tools.bench.model import GPT, GPTConfig, TokenStream
from zenflow.tools.bench.report import summarise, window_means
from zenflow.tools.bench.systems import SYSTEMS, system_unavailable_reason

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64",
        "--seq-len", "8", "--batch-size", "2", "--steps", "2", "--warmup", "1", "--rounds", "1",
        "--update-interval", "1", "--device", "cpu", "--dtype", "float32"]


def _args(extra):
    import argparse
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(TINY + extra)


def test_model_param_count_and_untied_head():
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=50, seq_len=8)
    model = GPT(cfg)
    assert model.num_params() == cfg.num_params()
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    x, y = TokenStream(50, 8, 3, seed=1).batch(0)
    assert x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    loss = model(x, y)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_token_stream_is_a_pure_function_of_seed_and_step():
    a, b = TokenStream(64, 8, 2, seed=3), TokenStream(64, 8, 2, seed=3)
    assert torch.equal(a.batch(5)[0], b.batch(5)[0])
    assert not torch.equal(a.batch(5)[0], a.batch(6)[0])


def test_bad_arguments_are_rejected_before_work():
    with pytest.raises(ValueError, match="--systems"):
        cli.build_spec(_args(["--systems", "adamw,nope"]))
    with pytest.raises(ValueError, match="n_embd"):
        cli.build_spec(_args(["--n-embd", "30", "--n-head", "4"]))
    with pytest.raises(ValueError, match="--select-interval"):
        cli.build_spec(_args(["--select-interval", "often"]))
    assert cli.build_spec(_args(["--select-interval", "8"]))[0]["zenflow"]["select_interval"] == 8
    with pytest.raises(ValueError, match="--topk-ratio"):
        cli.build_spec(_args(["--topk-ratio", "1.5"]))


def test_rounds_rotate_the_order_of_systems():
    assert harness.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert harness.round_order(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert harness.round_order(["a", "b", "c"], 3) == ["a", "b", "c"]


def test_window_means_use_whole_windows_only():
    assert window_means([1, 3, 2, 2, 9], 2) == [2.0, 2.0]


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


# Through child processes, as `zenflow bench` runs every system: AdamW (whose losses the test
# reads) and ZenFlow's defaults; every other system in process, below (a child process per system
# was most of this test's time).
THROUGH_CHILDREN = ["adamw", "zenflow-defaults"]


def _available_systems():
    return [s for s, (_, needs_ds) in SYSTEMS.items()
            if not needs_ds and system_unavailable_reason(s) is None]


@pytest.mark.slow
def test_bench_runs_available_systems_and_writes_json_and_png(tmp_path, capsys):
    systems = [s for s in THROUGH_CHILDREN if s in _available_systems()]
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli.run(_args(["--systems", ",".join(systems), "--json", str(out_json),
                        "--plot", str(out_png)]))
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert set(report["systems"]) == set(systems)
    for name in systems:
        entry = report["systems"][name]
        assert [r["round"] for r in entry["rounds"]] == [0], entry.get("error")
        s = entry["summary"]
        assert s["step_s"]["n"] == 2  # warm-up excluded
        assert s["rss_peak_mb"] > s["rss_after_model_mb"] * 0.5 > 0
        # Every system starts from the same weights on the same batch.
        assert s["loss_given_weights"] == pytest.approx(
            report["systems"][systems[0]]["summary"]["loss_given_weights"], rel=1e-6)
    if "zenflow-defaults" in systems:  # our optimizers report their stall and host time
        assert report["systems"]["zenflow-defaults"]["summary"]["stall_per_step_s"] is not None
    if "adamw" in systems:
        # The optimizer really trained: the first step's loss is the given weights' loss and
        # the weights moved afterwards.
        r = report["systems"]["adamw"]["rounds"][0]
        assert r["losses"][0] == pytest.approx(r["loss_given_weights"], rel=1e-6)
        assert r["losses"][1] != r["losses"][0]
    if len(systems) > 1:
        a, b = systems[:2]
        assert report["ratios"][a][b] == pytest.approx(1 / report["ratios"][b][a])
    w, h = _png_size(out_png)
    assert w > 500 and h > 200
    _png_size(tmp_path / "r_timeline.png")
    table = capsys.readouterr().out
    assert "speed-up" in table or len(systems) == 1
    for name in systems:
        assert name in table


@pytest.mark.slow
@pytest.mark.parametrize("name", [s for s in SYSTEMS if not SYSTEMS[s][1]
                                  and s not in THROUGH_CHILDREN])
def test_every_other_system_trains_and_reports_in_process(name, capsys):
    """What a bench child runs (systems.run_system), in this process: the system trains from the
    given weights, and the summary has its steps and, for our optimizers, the stall."""
    if (reason := system_unavailable_reason(name)) is not None:
        pytest.skip(reason)
    spec, _, _ = cli.build_spec(_args([]))
    spec = dict(spec, system=name)
    threads = torch.get_num_threads()
    try:   # (run_system sets the process's intra-op threads, as a child's are)
        result = systems_module.run_system(spec)
        reference = systems_module.run_system(dict(spec, system="adamw"))
    finally:
        torch.set_num_threads(threads)
    assert result["loss_given_weights"] == pytest.approx(reference["loss_given_weights"], rel=1e-6)
    assert result["losses"][0] == pytest.approx(result["loss_given_weights"], rel=1e-6)
    assert len(result["step_s"]) == 2   # warm-up excluded
    summary = summarise([dict(result, ok=True, round=0)], spec)
    assert summary["step_s"]["n"] == 2
    assert summary["stall_per_step_s"] is not None


def test_deepspeed_config_matches_the_seed_block():
    pytest.importorskip("deepspeed")
    from zenflow.tools.bench.systems import deepspeed_config
    spec, _, _ = cli.build_spec(_args(["--topk-ratio", "0.05", "--update-interval", "4"]))
    cfg = deepspeed_config(spec, zenflow=True)
    zf = cfg["zero_optimization"]["zenflow"]
    assert zf["topk_ratio"] == 0.05 and zf["update_interval"] == 4 and zf["overlap_step"] is True
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "zenflow" not in deepspeed_config(spec, zenflow=False)["zero_optimization"]
