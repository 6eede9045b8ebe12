"""The engine: same results as a hand-written loop, accumulation, fp16 scaling, bf16 masters."""
import logging
import math

import pytest
import torch

from zenflow.config.deepspeed_json import ConfigError
from zenflow.engine.engine import initialize
from zenflow.engine.loss_scaler import LossScaler
from zenflow.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

import helpers.engine_toys as toys


@pytest.fixture
def make_engine():
    """initialize(...) that closes every engine (and its optimizer's worker) after the test."""
    engines = []

    def make(model, cfg, **kw):
        out = initialize(model=model, config=cfg, **kw)
        engines.append(out[0])
        return out

    yield make
    for e in engines:
        e.close()


def _zenflow_kwargs(overlap):
    z = toys.SEED_ZERO_BLOCK["zero_optimization"]["zenflow"]
    return dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                topk_ratio=z["topk_ratio"], select_strategy=z["select_strategy"],
                select_interval=z["select_interval"], update_interval=z["update_interval"],
                full_warm_up_rounds=z["full_warm_up_rounds"], overlap_step=overlap)


def test_seed_config_trains_and_loss_falls(make_engine):
    engine, opt, _, _ = make_engine(toys.make_model(), toys.config("zenflow"))
    import zenflow
    assert isinstance(opt, zenflow.ZenFlowAdamW)
    before = toys.eval_loss(engine)
    losses = toys.train(engine, range(20))
    assert engine.global_steps == 20 and all(math.isfinite(v) for v in losses)
    engine.synchronize()
    # topk_ratio 0.05 updates 2 of 32 columns per step on the device, the rest every 4 steps:
    # slower than AdamW on this toy (3.52 -> 2.93 measured, AdamW reaches 1.67), but falling.
    assert toys.eval_loss(engine) < 0.9 * before


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_equals_hand_written_zenflow_loop(make_engine, overlap):
    import zenflow

    kind = "zenflow" if overlap else "zenflow-sync"
    engine, _, _, _ = make_engine(toys.make_model(), toys.config(kind))
    toys.train(engine, range(20))

    model = toys.make_model()
    with zenflow.ZenFlowAdamW(model.parameters(), **_zenflow_kwargs(overlap)) as opt:
        for t in range(20):
            x, y = toys.batch(t, 8)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        # The engine's state_dict() installs the in-flight host update (readers see current
        # weights), so the hand-written loop is compared after installing it too.
        opt.synchronize()
        for (name, a), b in zip(engine.module.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), name


def test_engine_equals_hand_written_adamw_loop_with_clipping_and_schedule(make_engine):
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5,
                                                 "warmup_max_lr": 1e-2}}
    cfg = toys.config("adamw", gradient_clipping=0.5, scheduler=sched)
    engine, opt, _, scheduler = make_engine(toys.make_model(), cfg)
    assert type(opt) is torch.optim.AdamW and isinstance(scheduler, WarmupDecayLR)
    toys.train(engine, range(20))

    model = toys.make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_sched = WarmupDecayLR(ref, total_num_steps=20, warmup_num_steps=5, warmup_max_lr=1e-2)
    for t in range(20):
        x, y = toys.batch(t, 8)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ref.step()
        ref_sched.step()
        ref.zero_grad()
    for (name, a), b in zip(engine.module.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert engine.get_lr() == [g["lr"] for g in ref.param_groups]


@pytest.mark.parametrize("kind", ["adamw", "offload", "zenflow-sync"])
def test_accumulating_four_micro_batches_equals_one_big_batch(make_engine, kind):
    big, _, _, _ = make_engine(toys.make_model(), toys.config(kind, batch_size=16, micro=16))
    acc, _, _, _ = make_engine(toys.make_model(), toys.config(kind, batch_size=16, micro=4))
    assert big.gradient_accumulation_steps() == 1 and acc.gradient_accumulation_steps() == 4
    boundaries = []
    for t in range(10):
        x, y = toys.batch(t, 16)
        torch.nn.functional.mse_loss(big(x), y).backward()  # plain backward: GA is 1
        big.step()
        for i in range(4):
            before = toys.weights(acc.module)
            boundaries.append(acc.is_gradient_accumulation_boundary())
            acc.backward(torch.nn.functional.mse_loss(acc(x[4 * i:4 * i + 4]),
                                                      y[4 * i:4 * i + 4]))
            acc.step()
            if i < 3:  # no optimizer step between boundaries
                assert all(torch.equal(before[k], v) for k, v in toys.weights(acc.module).items())
    assert boundaries == [False, False, False, True] * 10
    assert acc.global_steps == big.global_steps == 10 and acc.micro_steps == 40
    assert acc.global_samples == 160
    for (name, a), b in zip(acc.module.state_dict().items(), big.module.state_dict().values()):
        # Summing 4 micro-gradients instead of one big mean differs in the last bits; Adam's
        # g/sqrt(v) magnifies that for near-zero gradients (ZenFlow's host window measured 4e-6).
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 if "zenflow" in kind else 1e-6,
                                   msg=name)


@pytest.mark.parametrize("kind", ["adamw", "zenflow-sync"])
def test_fp16_overflow_skips_steps_lowers_the_scale_then_recovers(make_engine, kind):
    # 2**24 times a gradient of order 1 does not fit in fp16 (max 65504): early steps overflow.
    fp16 = {"enabled": True, "initial_scale_power": 24, "hysteresis": 2, "loss_scale_window": 5}
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2,
                                            "warmup_min_lr": 1e-3}}
    engine, _, _, scheduler = make_engine(toys.make_model(), toys.config(
        kind, fp16=fp16, scheduler=sched))
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    start_loss = toys.eval_loss(engine)
    scales, applied, losses = [], [], []
    for t in range(60):
        before = toys.weights(engine.module)
        it_before = scheduler.last_batch_iteration
        losses += toys.train(engine, range(t, t + 1))
        scales.append(engine.loss_scale)
        applied.append(engine.was_step_applied())
        changed = any(not torch.equal(before[k], v) for k, v in toys.weights(engine.module).items())
        if not applied[-1]:
            assert not changed, f"step {t} overflowed but the weights changed"
            assert scheduler.last_batch_iteration == it_before, "scheduler stepped on overflow"
        else:
            assert changed and scheduler.last_batch_iteration == it_before + 1
    assert applied[0] is False and applied[1] is False
    # hysteresis 2: the first overflow is absorbed, the second halves the scale
    assert scales[0] == 2.0 ** 24 and scales[1] == 2.0 ** 23
    assert engine.skipped_steps == applied.count(False) >= 2
    assert engine.global_steps == 60
    first_ok = applied.index(True)
    later = applied[first_ok:]
    assert later.count(True) >= 0.75 * len(later), applied
    # after loss_scale_window (5) clean steps in a row the scale doubles
    assert any(scales[i] == 2 * scales[i - 1] and all(applied[i - 4:i + 1])
               for i in range(first_ok + 4, len(scales))), scales
    assert min(scales) >= 1.0
    assert all(math.isfinite(v) for v in losses)
    engine.synchronize()
    assert toys.eval_loss(engine) < 0.8 * start_loss


def test_static_fp16_loss_scale_is_applied_and_kept(make_engine):
    engine, _, _, _ = make_engine(toys.make_model(), toys.config(
        "adamw", fp16={"enabled": True, "loss_scale": 128}))
    losses = toys.train(engine, range(15))
    assert engine.loss_scale == 128 and engine.skipped_steps == 0
    assert losses[-1] < losses[0]


def _float_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _float_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _float_tensors(v)


@pytest.mark.parametrize("kind", ["adamw", "zenflow"])
def test_bf16_weights_train_with_fp32_masters(make_engine, kind):
    engine, opt, _, _ = make_engine(toys.make_model(), toys.config(kind, bf16={"enabled": True}))
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    before = toys.eval_loss(engine)
    toys.train(engine, range(30))
    engine.synchronize()
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert toys.eval_loss(engine) < 0.9 * before
    state = opt.state_dict()
    low = [t.dtype for t in _float_tensors(state["state"])
           if t.is_floating_point() and t.dtype != torch.float32]
    assert not low, f"optimizer state holds low-precision tensors: {low}"
    if kind == "adamw":
        masters = engine._masters.masters
        assert all(m.dtype == torch.float32 for m in masters)
        # the weights are the masters rounded to bf16, and the masters hold more than that
        for p, m in zip(engine.module.parameters(), masters):
            assert torch.equal(p, m.to(torch.bfloat16))
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)


def test_initialize_returns_deepspeed_tuple_and_leaves_weights_alone(make_engine):
    model = toys.make_model()
    before = toys.weights(model)
    params = list(model.parameters())
    data = torch.utils.data.TensorDataset(*toys.batch(0, 20))
    cfg = toys.config("adamw", batch_size=8, micro=4)
    engine, opt, loader, sched = make_engine(model, cfg, training_data=data)
    assert engine.module is model and list(model.parameters())[0] is params[0]
    assert all(torch.equal(before[k], v) for k, v in toys.weights(model).items())
    assert loader.batch_size == 4 and sched is None and opt is engine.optimizer
    assert engine.train_batch_size() == 8 and engine.gradient_accumulation_steps() == 2
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


def test_config_file_path_is_accepted(make_engine, tmp_path):
    import json

    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps(toys.config("zenflow", gradient_accumulation_steps=2)))
    engine, opt, _, _ = make_engine(toys.make_model(), str(file))
    assert opt.topk_ratio == 0.05 and opt.update_interval == 4 and opt.overlap_step is True
    assert engine.train_micro_batch_size_per_gpu() == 4


def test_bad_config_fails_before_touching_the_model():
    model = toys.make_model()
    cfg = toys.config("adamw", bf16={"enabled": True}, zero_optimization={"stage": 3})
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        initialize(model=model, config=cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_optimizer_given_twice_is_refused():
    model = toys.make_model()
    with pytest.raises(ConfigError, match="optimizer is given both"):
        initialize(model=model, config=toys.config("adamw"),
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = toys.config("adamw")
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match="optimizer is missing"):
        initialize(model=model, config=cfg)


def test_client_optimizer_and_scheduler_factories(make_engine):
    cfg = toys.config("adamw", gradient_clipping=1.0)
    del cfg["optimizer"]
    engine, opt, _, sched = make_engine(
        toys.make_model(), cfg, optimizer=lambda groups: torch.optim.Adam(groups, lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5))
    assert type(opt) is torch.optim.Adam and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    before = toys.eval_loss(engine)
    toys.train(engine, range(20))
    assert toys.eval_loss(engine) < 0.8 * before
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 2)


def test_ignored_keys_are_logged_once(make_engine, caplog):
    cfg = toys.config("adamw", wall_clock_breakdown=True, zero_allow_untested_optimizer=True)
    with caplog.at_level(logging.INFO, logger="zenflow.engine"):
        engine, _, _, _ = make_engine(toys.make_model(), cfg)
        toys.train(engine, range(3))
    lines = [r.getMessage() for r in caplog.records if "without effect" in r.getMessage()]
    assert len(lines) == 1
    assert "wall_clock_breakdown" in lines[0] and "zero_allow_untested_optimizer" in lines[0]


# --- the schedules, against DeepSpeed's formulas -----------------------------------------------

def _opt(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(sched, n):
    out = [sched.optimizer.param_groups[0]["lr"]]
    for _ in range(n):
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear():
    lrs = _lrs(WarmupLR(_opt(), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10), 14)
    # construction sets the start value (iteration -1), step k sets iteration k-1
    expect = [0.01] + [0.01 + 0.09 * math.log(t + 1) / math.log(10) for t in range(10)] + [0.1] * 4
    assert lrs == pytest.approx(expect)
    lin = _lrs(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4,
                        warmup_type="linear"), 6)
    assert lin == pytest.approx([0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1])
    # warmup_max_lr defaults to the optimizer's lr
    assert _lrs(WarmupLR(_opt(0.3), warmup_num_steps=2), 3)[-1] == pytest.approx(0.3)


def test_warmup_decay_lr_reaches_zero_at_total_steps():
    lrs = _lrs(WarmupDecayLR(_opt(), total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=2,
                             warmup_type="linear"), 12)
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.05, 0.1])
    assert lrs[4] == pytest.approx(0.1 * 7 / 8)     # iteration 3: (10 - 3) / (10 - 2)
    assert lrs[11] == 0.0 and lrs[12] == 0.0


def test_warmup_cosine_lr_ends_at_cos_min_ratio():
    s = WarmupCosineLR(_opt(0.2), total_num_steps=12, warmup_num_steps=2, cos_min_ratio=0.1,
                       warmup_type="linear")
    lrs = _lrs(s, 15)
    assert lrs[0] == 0.0 and lrs[3] == pytest.approx(0.2 * (0.1 + 0.9 * (1 + math.cos(
        math.pi / 10)) / 2))
    assert lrs[12] == pytest.approx(0.02) and lrs[15] == pytest.approx(0.02)
    restored = WarmupCosineLR(_opt(0.5), total_num_steps=12, warmup_num_steps=2,
                              cos_min_ratio=0.1, warmup_type="linear")
    restored.load_state_dict(s.state_dict())
    assert restored.get_last_lr() == pytest.approx(s.get_last_lr())


def test_loss_scaler_hysteresis_window_and_floor():
    s = LossScaler(init_scale=8.0, scale_window=2, hysteresis=2, min_scale=2.0)
    seen = []
    for overflow in [True, True, True, True, False, False, True, False, False]:
        s.update(overflow)
        seen.append(s.loss_scale)
    # absorbed, halved, halved, floor; clean; window of 2 reached: doubled (hysteresis refilled);
    # the next overflow is absorbed again; two clean steps: doubled
    assert seen == [8, 4, 2, 2, 2, 4, 4, 4, 8]
    c = LossScaler(init_scale=8.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    for overflow in [True, False, True, False, True]:
        c.update(overflow)
    assert c.loss_scale == 8.0  # never two overflows in a row
    c.update(True)
    assert c.loss_scale == 4.0


def test_empty_zenflow_block_runs_deepspeed_defaults(make_engine, caplog):
    # DeepSpeed's defaults: update_interval and select_interval "auto", overlap_step false.
    cfg = toys.config("adamw", zero_optimization={
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"offload": True}})
    with caplog.at_level(logging.INFO, logger="zenflow.engine"):
        engine, opt, _, _ = make_engine(toys.make_model(), cfg)
    assert opt.update_interval == "auto" and opt.overlap_step is False
    assert opt.topk_ratio == 0.1 and opt.auto_ratio == 0.99
    assert any("without effect here: zero_optimization.zenflow.offload" in r.getMessage()
               for r in caplog.records)
    before = toys.eval_loss(engine)
    toys.train(engine, range(20))
    engine.synchronize()
    assert toys.eval_loss(engine) < 0.9 * before


def test_steps_per_epoch_comes_from_the_dataloader(make_engine):
    data = torch.utils.data.TensorDataset(*toys.batch(0, 40))
    cfg = toys.config("zenflow", batch_size=8, micro=4)
    cfg["zero_optimization"]["zenflow"]["select_strategy"] = "epoch"
    cfg["zero_optimization"]["zenflow"]["select_interval"] = 1
    engine, opt, loader, _ = make_engine(toys.make_model(), cfg, training_data=data)
    assert len(loader) == 10 and opt.steps_per_epoch == 5  # 10 micro-batches, 2 per step
    for x, y in loader:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 5


@pytest.mark.parametrize("how", ["load_module_only", "no_optimizer_states", "module_load"])
def test_bf16_plain_adamw_keeps_weights_loaded_outside_the_optimizer(make_engine, tmp_path, how):
    """bf16 with plain AdamW (fp32 masters in the engine): weights loaded by load_module_only,
    load_optimizer_states=False or module.load_state_dict survive the next step (issue 24,
    item 4); at lr 0 the step leaves them exactly as loaded."""
    engine, opt, _, _ = make_engine(toys.make_model(), toys.config("adamw", bf16={"enabled": True}))
    toys.train(engine, range(3))
    engine.save_checkpoint(tmp_path, tag="early")
    loaded = toys.weights(engine.module)
    toys.train(engine, range(3, 8))
    if how == "module_load":
        engine.module.load_state_dict(loaded)
    else:
        engine.load_checkpoint(tmp_path, tag="early", load_module_only=how == "load_module_only",
                               load_optimizer_states=False)
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    toys.train(engine, range(8, 9))
    for name, value in toys.weights(engine.module).items():
        assert torch.equal(value, loaded[name]), name


def test_every_collective_of_the_engine_names_its_device(make_engine, monkeypatch):
    """The engine's collectives (the first broadcast, gradient averaging, checkpoint agreement)
    run on the engine's device, passed explicitly: without it a device backend used the current
    CUDA device, cuda:0 on every rank of a script that never called torch.cuda.set_device."""
    from zenflow.distributed import Partition
    asked = []
    original = Partition.from_group.__func__

    def spy(cls, group, device, rows_are_local=False):
        asked.append(device)
        return original(cls, group, device, rows_are_local)
    monkeypatch.setattr(Partition, "from_group", classmethod(spy))
    engine, *_ = make_engine(toys.make_model(), toys.config("zenflow"))
    for step in range(3):
        x, y = toys.batch(step, 8)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert len(asked) >= 3 and all(d == engine.device for d in asked), asked
    with pytest.raises(TypeError):
        Partition.from_group(None)


def test_a_forked_child_exiting_does_not_mark_its_rank_as_exited(tmp_path):
    """A data-loader worker forked from a rank runs the rank's atexit hooks when it exits: the
    other ranks must not read that as the rank's own exit."""
    import os

    from torch.distributed import FileStore

    from zenflow.engine.rank_agreement import StepAgreement
    agreement = StepAgreement(FileStore(str(tmp_path / "store"), 2), rank=1, world_size=2)
    child = os.fork()
    if child == 0:
        agreement._mark_exited()
        os._exit(0)
    os.waitpid(child, 0)
    assert not agreement._store.check(["exited/1"])
    agreement._mark_exited()
    assert agreement._store.check(["exited/1"])
