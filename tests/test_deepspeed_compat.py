"""DeepSpeed client scripts run with `import zenflow as deepspeed`: the Getting-Started-style
script on 1 process and under torchrun with 2 gloo ranks, and each piece of DeepSpeed's client
surface (comm, accelerator, engine attributes and keyword arguments, config conventions)."""
import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zenflow
from zenflow import comm
from zenflow.config.deepspeed_json import ConfigError, parse_config
from zenflow.engine.engine import initialize

import helpers.engine_toys as toys
from helpers.children import ROOT, program

SCRIPT = program("ds_getting_started.py")
ZENFLOW_CONFIG = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "zenflow": {"topk_ratio": 0.25, "update_interval": 2,
                                      "select_strategy": "step", "select_interval": 4,
                                      "overlap_step": True}}}


def run_script(tmp_path, launcher: list[str], ranks: int, init_distributed=True) -> list[dict]:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(ZENFLOW_CONFIG))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["SKIP_INIT_DISTRIBUTED"] = "0" if init_distributed else "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU: two ranks must not need two GPUs
    run = subprocess.run(launcher + [str(SCRIPT), "--deepspeed", "--deepspeed_config", str(cfg),
                                     "--save_dir", str(tmp_path / "ckpt"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r, res in enumerate(results):
        assert res["rank"] == res["global_rank"] == res["local_rank"] == r
        assert res["world_size"] == res["dp_world_size"] == ranks
        assert res["zero_stage"] == 2
        assert res["missing_checkpoint"] == [None, None]   # no checkpoint yet: DeepSpeed's answer
        assert res["loaded"] == ["epoch1", {"epoch": 1}]    # (path, client_state)
        assert res["eval_after"] < 0.85 * res["eval_before"]
        assert res["eval_loaded"] == res["eval_after"]
        assert res["grad_norm"] > 0
    return results


@pytest.mark.slow
def test_getting_started_script_runs_on_one_process(tmp_path):
    (res,) = run_script(tmp_path, [sys.executable], ranks=1)
    assert len(res["losses"]) == 2 * 128 // 8  # micro-batches of 8, two epochs


@pytest.mark.slow
@pytest.mark.parametrize("init_distributed", [True, False],
                         ids=["init_distributed", "initialize-sets-up-the-group"])
def test_getting_started_script_runs_under_torchrun_with_two_gloo_ranks(tmp_path,
                                                                        init_distributed):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2"]
    results = run_script(tmp_path, launcher, ranks=2, init_distributed=init_distributed)
    assert [len(r["losses"]) for r in results] == [16, 16]  # each rank gets half of the data
    weights = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k  # the ranks trained as one


# --- the pieces -------------------------------------------------------------------------------

@pytest.fixture
def make_engine():
    engines = []

    def make(cfg=None, **kw):
        kw.setdefault("model", toys.make_model())
        engine = initialize(config=cfg if cfg is not None else toys.config("adamw"), **kw)[0]
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.close()


def test_add_config_arguments_and_one_config_source(tmp_path):
    parser = zenflow.add_config_arguments(argparse.ArgumentParser())
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(toys.config("adamw")))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(cfg)])
    assert args.deepspeed is True and args.deepspeed_config == str(cfg)
    with pytest.raises(ValueError, match=r"config is given 2 times \(config=, "
                                         r"args.deepspeed_config\); give exactly one"):
        initialize(model=toys.make_model(), args=args, config=toys.config("adamw"))
    with pytest.raises(ValueError, match=r"config is given 2 times \(config=, config_params="):
        initialize(model=toys.make_model(), config=toys.config("adamw"),
                   config_params=toys.config("adamw"))
    with pytest.raises(ValueError, match="no config: pass config="):
        initialize(model=toys.make_model(), args=parser.parse_args([]))
    engine, *_ = initialize(model=toys.make_model(), args=args)
    assert engine.train_batch_size() == 8
    engine.close()


def test_unsupported_initialize_arguments_are_named():
    for kw in ({"mpu": object()}, {"mesh_param": (2, 2)}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.*not support"):
            initialize(model=toys.make_model(), config=toys.config("adamw"), **kw)
    with pytest.raises(TypeError, match="dist_init_required must be True, False or None"):
        initialize(model=toys.make_model(), config=toys.config("adamw"), dist_init_required=1)


def test_launched_ranks_without_a_group_never_train_alone(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but no process group exists and "
                                           "dist_init_required=False"):
        initialize(model=toys.make_model(), config=toys.config("adamw"),
                   dist_init_required=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but torch.distributed is not "
                                           "initialized; call zenflow.init_distributed"):
        comm.get_rank()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set; launch with torchrun"):
        comm.init_distributed(dist_backend="gloo")
    with pytest.raises(ValueError, match="dist_backend='nccl' needs CUDA") if not \
            torch.cuda.is_available() else pytest.raises(RuntimeError):
        comm.init_distributed(dist_backend="nccl")
    with pytest.raises(ValueError, match="dist_backend='tcp' is not a torch.distributed backend"):
        comm.init_distributed(dist_backend="tcp")


def test_comm_in_a_lone_process_answers_for_rank_0_of_1():
    assert not comm.is_initialized()
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()) == (0, 1, 0)
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    comm.barrier()
    assert torch.equal(t, torch.ones(3))
    out = [torch.zeros(3)]
    comm.all_gather(out, t)
    assert torch.equal(out[0], t)
    objs = [None]
    comm.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]


def test_get_accelerator_names_the_device():
    acc = zenflow.get_accelerator()
    assert acc is zenflow.get_accelerator()
    if torch.cuda.is_available():
        assert acc.device_name(1) == "cuda:1" and acc.communication_backend_name() == "nccl"
    else:
        assert acc.device_name(0) == "cpu" and acc.current_device_name() == "cpu"
        assert acc.communication_backend_name() == "gloo" and acc.device_count() == 1
    assert torch.zeros(1).to(acc.device_name(0)).device.type == acc.device(0).type


def test_engine_attributes(make_engine):
    engine = make_engine(toys.config("adamw", batch_size=8, micro=4, gradient_clipping=0.5,
                                     bf16={"enabled": True}))
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) \
        == (0, 0, 1, 1)
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.zero_optimization() is False and engine.zero_optimization_stage() == 0
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.get_global_grad_norm() is None
    toys.train(engine, range(1))
    # The norm DeepSpeed reports: of the unscaled gradients before clipping, fp32 masters here.
    model = toys.make_model()
    model.to(torch.bfloat16)
    x, y = toys.batch(0, 8)
    for i in (0, 4):
        (torch.nn.functional.mse_loss(model(x[i:i + 4].to(torch.bfloat16)).float(),
                                      y[i:i + 4]) / 2).backward()
    expected = torch.nn.utils.get_total_norm([p.grad.float() for p in model.parameters()])
    assert engine.get_global_grad_norm() == pytest.approx(expected.item(), rel=1e-2)
    assert engine.get_global_grad_norm() > 0.5  # so clipping to 0.5 applied after it


def test_set_train_batch_size_and_boundary_override(make_engine):
    engine = make_engine(toys.config("adamw", batch_size=8, micro=4))
    assert engine.gradient_accumulation_steps() == 2
    with pytest.raises(ValueError, match="positive multiple of train_micro_batch_size_per_gpu "
                                         r"\* world size = 4, got 6"):
        engine.set_train_batch_size(6)
    engine.set_train_batch_size(12)
    assert engine.gradient_accumulation_steps() == 3 and engine.train_batch_size() == 12
    boundaries = []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert boundaries == [False, False, True] * 2 and engine.global_steps == 2
    engine.step()
    with pytest.raises(RuntimeError, match="middle of gradient accumulation"):
        engine.set_train_batch_size(8)
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)
    assert not engine.is_gradient_accumulation_boundary()
    with pytest.raises(TypeError, match="is_boundary must be True, False or None, got 1"):
        engine.set_gradient_accumulation_boundary(1)


def test_no_sync_destroy_and_checkpoint_keywords(make_engine, tmp_path, caplog):
    engine = make_engine(toys.config("zenflow"))
    with engine.no_sync():  # one process: nothing to average, nothing refused
        toys.train(engine, range(2))
    with caplog.at_level(logging.WARNING, logger="zenflow.engine"):
        assert engine.load_checkpoint(tmp_path / "none") == (None, None)
    assert "has no 'latest' file" in caplog.text
    path = engine.save_checkpoint(tmp_path, 2.3026, client_state={"step": 2},
                                  exclude_frozen_parameters=False)
    assert path and Path(path).name == "2.3026"  # DeepSpeed's tutorial tags with a loss value
    seen = {}
    other = make_engine(toys.config("zenflow"))
    out = other.load_checkpoint(tmp_path, tag=2.3026, load_module_strict=False,
                                custom_load_fn=lambda src, dst: seen.update(src=src, dst=dst))
    assert out == (path, {"step": 2}) and seen["dst"] is other.module
    assert seen["src"].keys() == engine.module.state_dict().keys()
    engine.destroy()
    with pytest.raises(RuntimeError, match="after close"):
        engine.optimizer.step()


def test_zero_optimization_true_is_stage_1_and_auto_values():
    assert parse_config(dict(toys.config("adamw"), zero_optimization=True),
                        world_size=1).zero_optimization.stage == 1
    assert parse_config(dict(toys.config("adamw"), zero_optimization=False),
                        world_size=1).zero_optimization.stage == 0
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    derived = parse_config(dict(base, train_batch_size=32, train_micro_batch_size_per_gpu="auto",
                                gradient_accumulation_steps=2), world_size=2)
    assert derived.train_micro_batch_size_per_gpu == 8
    derived = parse_config(dict(base, train_batch_size="auto", train_micro_batch_size_per_gpu=4,
                                gradient_accumulation_steps="auto"), world_size=2)
    assert (derived.train_batch_size, derived.gradient_accumulation_steps) == (8, 1)
    with pytest.raises(ConfigError, match="train_batch_size and train_micro_batch_size_per_gpu "
                                          "are \"auto\" and cannot be derived: set "
                                          "train_micro_batch_size_per_gpu"):
        parse_config(dict(base, train_batch_size="auto", train_micro_batch_size_per_gpu="auto"),
                     world_size=1)
    hf_style = dict(base, train_micro_batch_size_per_gpu=4, gradient_clipping="auto",
                    fp16={"enabled": "auto"},
                    optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
                    zero_optimization={"stage": 2, "reduce_bucket_size": "auto",
                                       "zenflow": {"update_interval": "auto"}})
    with pytest.raises(ConfigError) as err:
        parse_config(hf_style, world_size=1)
    problems = err.value.problems
    assert any(p.startswith('gradient_clipping is "auto", which only the Hugging Face Trainer '
                            "fills in") and p.endswith("set a number (0 turns clipping off)")
               for p in problems)
    assert any(p.startswith('fp16.enabled is "auto"') and "set true or false" in p
               for p in problems)
    assert any(p.startswith('optimizer.params.lr is "auto"') for p in problems)
    assert any(p.startswith('optimizer.params.betas is "auto"') for p in problems)
    assert not any("zero_optimization" in p for p in problems)  # auto is fine there
    # DeepSpeed's bounds for auto_ratio, 0 to 1 inclusive (issue 26)
    assert parse_config(dict(base, train_batch_size=8,
                             zero_optimization={"zenflow": {"auto_ratio": 0.0}}),
                        world_size=1).zenflow.auto_ratio == 0.0
    with pytest.raises(ConfigError, match=r"zero_optimization.zenflow.auto_ratio must be "
                                          r"between 0 and 1, got 1.5"):
        parse_config(dict(base, train_batch_size=8,
                          zero_optimization={"zenflow": {"auto_ratio": 1.5}}), world_size=1)
    with pytest.raises(ConfigError, match="dist_backend must be one of nccl, gloo"):
        parse_config(dict(base, train_batch_size=8, dist_backend="tcp"), world_size=1)


def test_data_parallel_no_sync_refuses_a_boundary_step(make_engine, monkeypatch):
    """Under data parallel (simulated: the engine sees a 2-rank partition), a boundary step inside
    no_sync() would average gradients, so it is refused. (Evaluation under data parallel, which
    installs the pending update when every rank evaluates, runs on two real ranks in
    test_deepspeed_launch.py.)"""
    import zenflow.distributed
    engine = make_engine(toys.config("zenflow", batch_size=8, micro=4))
    two_ranks = zenflow.distributed.Partition(rank=0, world_size=2)
    monkeypatch.setattr(zenflow.engine.engine.Partition, "from_group",
                        classmethod(lambda cls, group, device: two_ranks))
    x, y = toys.batch(0, 4)
    with engine.no_sync():
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()  # not a boundary: fine
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        with pytest.raises(RuntimeError, match="boundary inside no_sync"):
            engine.step()
