"""DeepSpeed scripts run unchanged (`import deepspeed`) through `zenflow launch`, on 1 process and
on 2 gloo ranks, with a checkpoint saved and resumed; the served and refused `deepspeed` names;
and the engine under data parallel as DeepSpeed clients drive it: evaluation on every rank sees
the synchronized weights, tags that differ per rank, a save called on rank 0 only."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zenflow.engine.weight_sync import READ_DEADLINE_S
from zenflow.tools import cli
from zenflow.tools import launch as launch_tool

from helpers.children import ROOT, program, with_root_on_path
from helpers.dist_ranks import EVAL_EVERY, single_process_eval_run
from helpers.spawn import assert_ok, assert_same, run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "zenflow": {"topk_ratio": 0.25, "update_interval": 2,
                                      "select_strategy": "step", "select_interval": 4,
                                      "overlap_step": True}}}


def run_launch(tmp_path, script: str, ranks: int, *script_args: str
               ) -> subprocess.CompletedProcess:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)),
        CUDA_VISIBLE_DEVICES="")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "zenflow", "launch", "--num_gpus", str(ranks),
            str(program(script)), "--deepspeed", "--deepspeed_config", str(cfg),
            "--out", str(tmp_path / "out"), *script_args]
    # In a session of its own, so that a hang stops torchrun too, not only the launcher
    # (subprocess.run's timeout would leave torchrun and the ranks running). The ranks are in
    # sessions of their own: torchrun stops them when it gets SIGTERM.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=tmp_path, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            pytest.fail(f"zenflow launch still running after 240 s: a hang\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def launch(tmp_path, script: str, ranks: int, *script_args: str) -> tuple[list[dict], str]:
    run = run_launch(tmp_path, script, ranks, *script_args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    served = [line for line in run.stderr.splitlines() if "zenflow launch: serving" in line]
    assert len(served) == 1, run.stderr[-3000:]   # printed once, by rank 0
    return [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())
            for r in range(ranks)], run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_cifar_style_script_runs_unchanged_through_the_launcher(tmp_path, ranks):
    results, stderr = launch(tmp_path, "ds_cifar_style.py", ranks, "--save_dir",
                             str(tmp_path / "ckpt"), "--moe-param-group")
    for res in results:
        assert res["world_size"] == ranks
        assert len(res["losses"]) == 2 * 128 // (8 * ranks)
        # resumed from rank 0's tag (each rank passed its own loss as the tag)
        assert res["loaded"][1] == {"epoch": 1}
        assert res["loaded"][0] == results[0]["loaded"][0]
        assert res["resumed_test_loss"] == pytest.approx(res["test_loss"], rel=1e-6)
    if ranks == 2:
        assert results[0]["test_loss"] == results[1]["test_loss"]   # evaluated the same weights
        assert results[0]["weights"] == results[1]["weights"]
        assert results[0]["losses"] != results[1]["losses"]   # (each rank had its own share)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == results[0]["loaded"][0]
    assert len([p for p in ckpt.iterdir() if p.is_dir()]) == 2   # one per epoch, not per rank


def tiny_llama(folder: Path) -> Path:
    """A Llama of a few thousand parameters saved as a Hugging Face model folder (config and
    weights), which `from_pretrained` loads offline as it would a downloaded Llama-2."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_finetune_llama_style_script_runs_unchanged_through_the_launcher(tmp_path, ranks):
    """DeepSpeed-ZenFlow's finetune_llama.py imports transformers, whose DeepSpeed check (and
    accelerate's) asks importlib for `deepspeed`'s spec: the served modules have one."""
    pytest.importorskip("accelerate")
    model = tiny_llama(tmp_path / "tiny-llama")
    results, _ = launch(tmp_path, "ds_finetune_llama_style.py", ranks, "--output_dir",
                        str(tmp_path / "ckpt"), "--model_name", str(model))
    for res in results:
        assert len(res["losses"]) == 2 * 64 // (8 * ranks)
        assert res["client_state"] == {"global_step": len(res["losses"])}
        assert res["resumed_eval_loss"] == pytest.approx(res["eval_loss"], rel=1e-6)
        # No `deepspeed` distribution is installed, so both libraries keep their own DeepSpeed
        # code off and the script's deepspeed.initialize is zenflow's.
        assert res["deepspeed_checks"] == {"find_spec": "deepspeed", "transformers": False,
                                           "accelerate": False}
    assert len({res["eval_loss"] for res in results}) == 1


@pytest.mark.slow
def test_finetune_llama_style_save_on_rank_0_only_fails_within_seconds(tmp_path):
    """finetune_llama.py saves on rank 0 only; rank 1's script then ends. The save cannot be made
    (rank 1 held half of the host state), and rank 0 says so as soon as rank 1 has exited,
    not after the 30-minute collective deadline."""
    pytest.importorskip("accelerate")
    model = tiny_llama(tmp_path / "tiny-llama")
    start = time.monotonic()
    run = run_launch(tmp_path, "ds_finetune_llama_style.py", 2, "--output_dir",
                     str(tmp_path / "ckpt"), "--model_name", str(model), "--save_on_rank_0_only")
    assert run.returncode != 0
    assert ("save_checkpoint is collective: every rank must call it (each rank writes its share "
            "of the optimizer state, and installing the in-flight update is collective), but "
            "rank(s) 1 ended without calling it (the process exited)") in run.stderr, \
        run.stderr[-5000:]
    assert time.monotonic() - start < 200   # the deadline is 1800 s
    assert not (tmp_path / "ckpt" / "latest").exists()


@pytest.mark.slow   # zenflow launch in a child process
def test_served_names_and_refused_ones(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    script = program("deepspeed_names.py")
    run = subprocess.run([sys.executable, "-m", "zenflow", "launch", str(script), "--x"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "args ['--x', '--local_rank=0']" in run.stdout   # as DeepSpeed's launcher passes it
    refused = [line for line in run.stdout.splitlines() if line.startswith("refused")]
    assert len(refused) == 4, run.stdout
    assert "deepspeed.runtime is not served by zenflow: DeepSpeed's engine internals" in refused[0]
    assert "deepspeed.pipe is not served by zenflow: pipeline parallelism" in refused[1]
    assert "deepspeed.nothing is not served by zenflow (served: deepspeed, " in refused[2]
    assert "deepspeed.zero is not served by zenflow" in refused[3]


@pytest.mark.slow   # two child processes
def test_importing_zenflow_never_shadows_deepspeed():
    run = subprocess.run([sys.executable, str(program("zenflow_leaves_deepspeed_alone.py"))],
                         capture_output=True, text=True, timeout=120, env=with_root_on_path())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(("no deepspeed", "real "))
    run = subprocess.run([sys.executable, str(program("deepspeed_imported_first.py"))],
                         capture_output=True, text=True, timeout=120, env=with_root_on_path())
    assert "a real DeepSpeed is already imported" in run.stdout, run.stderr


def test_launch_maps_deepspeed_options_onto_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")

    def parsed(*argv):
        parser = cli.argparse.ArgumentParser()
        launch_tool.add_arguments(parser)
        return parser.parse_args([*argv])

    cmd, env = launch_tool.command(parsed(str(script), "--deepspeed", "-v"))
    assert cmd[1:] == ["-m", launch_tool.RUNNER, str(script), "--deepspeed", "-v"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("0", "1", "0")
    cmd, _ = launch_tool.command(parsed("--num_gpus", "2", "--no_local_rank", str(script)))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                       "-m", launch_tool.RUNNER, "--no_local_rank", str(script)]
    cmd, _ = launch_tool.command(parsed("--num_gpus", "4", "--num_nodes", "2", "--node_rank", "1",
                                        "--master_addr", "10.0.0.1", str(script)))
    assert cmd[5:13] == ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                         "--master_port", "29500"]
    for argv, message in ((["--hostfile", "h", str(script)], "--hostfile: not supported"),
                          (["--num_gpus", "0", str(script)], "--num_gpus must be a positive"),
                          (["--num_nodes", "2", "--node_rank", "2", str(script)],
                           "--node_rank 2 is outside --num_nodes 2"),
                          ([str(tmp_path / "missing.py")], "is not a file")):
        with pytest.raises(ValueError, match=message):
            launch_tool.command(parsed(*argv))


@pytest.mark.slow   # zenflow launch in a child process
def test_launcher_flags_never_take_the_script_name(tmp_path):
    """DeepSpeed's store_true options stay flags: `--bind_cores_to_rank train.py` (DeepSpeedExamples'
    run_ds.sh) runs train.py; a refused flag is refused by its name, not as a missing script."""
    script = program("print_args.py")

    def parsed(*argv):
        parser = cli.argparse.ArgumentParser()
        launch_tool.add_arguments(parser)
        return parser.parse_args([*argv])

    cmd, _ = launch_tool.command(parsed("--bind_cores_to_rank", str(script), "--deepspeed"))
    assert cmd[1:] == ["-m", launch_tool.RUNNER, str(script), "--deepspeed"]
    for flag in launch_tool.UNSUPPORTED_FLAGS:
        args = parsed(f"--{flag}", str(script))
        assert args.user_script == str(script)
        with pytest.raises(ValueError, match=f"--{flag}: not supported"):
            launch_tool.command(args)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-m", "zenflow", "launch", "--bind_cores_to_rank",
                          str(script), "--x"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ran ['--x', '--local_rank=0']" in run.stdout
    assert f"zenflow launch: {launch_tool.BIND_CORES_NOTE}" in run.stderr


@pytest.mark.slow
def test_evaluation_on_every_rank_sees_the_synchronized_weights(tmp_path):
    steps = 3 * EVAL_EVERY
    ranks = run_ranks(tmp_path, "eval_loop", overlap=True, steps=steps, timeout=120)
    assert_ok(ranks)
    reference = single_process_eval_run(steps)
    for r in ranks:
        assert len(r["evals"]) == len(reference) == 3
        for seen, expected in zip(r["evals"], reference):
            assert_same(seen, expected, exact=False)
    for a, b in zip(ranks[0]["evals"], ranks[1]["evals"]):
        assert_same(a, b, exact=True)
    # not vacuous: an update was in flight at some evaluation
    assert any(not torch.equal(before[k], seen[k]) for before, seen in
               zip(ranks[0]["before_eval"], ranks[0]["evals"]) for k in seen)
    # rank 0 evaluating alone neither hung nor installed anything: the ranks stay in step
    assert_same(ranks[0]["after"], ranks[1]["after"], exact=True)
    assert any("data parallel: a forward pass in eval mode or under no_grad on rank 0" in w
               for w in ranks[0]["warnings"]), ranks[0]["warnings"]
    assert not ranks[1]["warnings"]


@pytest.mark.slow
def test_evaluation_on_rank_0_alone_does_not_wait_for_ranks_that_wait_elsewhere(tmp_path):
    """Rank 0 evaluating alone while the others wait in a barrier or a save reads at once (it
    used to wait out the 10 s deadline each time); the warning says how to evaluate current
    weights on one rank, and doing so (engine.eval() on every rank) waits for nothing either."""
    zero, one = run_ranks(tmp_path, "eval_alone_while_others_wait", timeout=120)
    assert_ok([zero, one])
    for name in ("beside_a_barrier_s", "beside_a_save_s", "after_eval_on_every_rank_s"):
        assert zero[name] < READ_DEADLINE_S / 2, (name, zero[name])
    assert_same(zero["synchronized"], one["synchronized"], exact=True)
    assert_same(zero["after"], one["after"], exact=True)   # the ranks stayed in step
    assert (tmp_path / "ckpt" / "latest").exists()
    warned = [w for w in zero["warnings"] if w.startswith("data parallel: ")]
    assert len(warned) == 1 and ("To evaluate current weights on one rank, call engine.eval() "
                                 "(or engine.synchronize()) on every rank first") in warned[0]
    assert not one["warnings"]


@pytest.mark.slow
def test_checkpoint_tags_and_a_save_on_rank_0_only(tmp_path):
    ranks = run_ranks(tmp_path, "checkpoint_calls", overlap=True, timeout=120)
    zero, one = ranks
    assert zero is not None and "error" not in zero, zero and zero.get("error")
    assert Path(zero["path"]).name == Path(one["path"]).name == "loss0.5"   # rank 0's tag
    assert (tmp_path / "ckpt" / "latest").read_text() == "loss0.5"
    assert any("the ranks passed different tags (loss0.5, loss1.5); saving under rank 0's tag"
               in w for w in zero["warnings"]), zero["warnings"]
    for r in ranks:   # refused on every rank alike, so none waits for another
        assert 'checkpoint.tag_validation is "Fail"' in r["fail_error"]
    assert not (tmp_path / "ckpt" / "other0").exists()
    assert zero["lone_save_error"].startswith("save_checkpoint is collective: every rank must "
                                              "call it")
    assert "rank(s) 1 went on training without calling it" in zero["lone_save_error"]
    assert not (tmp_path / "ckpt" / "rank0_only").exists()


@pytest.mark.slow
def test_a_save_on_rank_0_learns_within_seconds_that_the_other_ranks_exited(tmp_path):
    """finetune_llama.py saves on rank 0 only and the other ranks' scripts end: rank 0 must not
    wait out the collective deadline (30 minutes) to say that the save cannot be made."""
    zero, one = run_ranks(tmp_path, "save_after_a_rank_exits", timeout=90)
    assert one is not None and "error" not in one, one and one.get("error")
    assert zero is not None and "error" not in zero, zero and zero.get("error")
    assert zero["save_error"].startswith("save_checkpoint is collective: every rank must call it")
    assert "rank(s) 1 ended without calling it (the process exited)" in zero["save_error"]
    assert zero["save_s"] < 30, zero["save_s"]   # rank 1's exit itself takes a second or two
    assert not (tmp_path / "ckpt" / "latest").exists()


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_a_bad_master_port_is_refused_by_name(tmp_path, port):
    script = tmp_path / "train.py"
    script.write_text("")
    parser = cli.argparse.ArgumentParser()
    launch_tool.add_arguments(parser)
    with pytest.raises(ValueError, match=f"--master_port must be a TCP port in 1..65535, got {port}"):
        launch_tool.command(parser.parse_args(["--master_port", port, str(script)]))


@pytest.mark.slow   # zenflow launch and its training process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_its_processes(tmp_path, signum):
    """A scheduler's SIGTERM (or Ctrl-C) to `zenflow launch` goes on to the training process,
    whose handler runs, and the launcher returns its exit status: no process is orphaned."""
    marker = tmp_path / "handled"
    env = with_root_on_path(CUDA_VISIBLE_DEVICES="")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "zenflow", "launch", "--no_local_rank",
                             str(program("exits_7_on_a_signal.py")), str(marker), str(int(signum))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 7
        assert marker.read_text() == str(int(signum))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
