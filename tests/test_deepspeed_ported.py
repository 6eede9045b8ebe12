"""DeepSpeed's own ZenFlow unit tests, ported to zenflow (issue 26, item 4).

Ported from deepspeedai/DeepSpeed (master, 2026; the same files as v0.19.5):
  tests/unit/runtime/zenflow/test_zf.py         the engine matrix (ZeRO stage x warm-up x
                                                `offload` x (select_strategy, select_interval,
                                                update_interval)) on 1 and 2 ranks, and the
                                                core split (test_split_affinity)
  tests/unit/runtime/zenflow/test_zf_config.py  the config blocks
  tests/unit/ops/adam/test_zf_torch_adam.py     the selective optimizer, where a client can see
                                                it: updated columns, 1-D parameters, the state
                                                keys and their step count, AdamW equality
and DeepSpeed's selection and window schedule (deepspeed/runtime/zenflow/engine.py,
is_zenflow_update_boundary; zenflow_stage_1_and_2.py, is_zenflow_select_boundary), written out
below as `deepspeed_schedule` and compared with what our optimizer decides.

The assertions are DeepSpeed's where it has them; its engine matrix asserts nothing (and returns
at once on a CPU), so the port asserts what the run must show: finite losses, moved weights,
identical ranks and the schedule DeepSpeed's code gives. Cases where we differ on purpose assert
our behaviour, say why in a comment starting "Deliberate:", and are listed in docs/deepspeed.md
("Deliberate differences"). ZeRO stage 3 is FSDP2's here: a model must be wrapped with
fully_shard first (tests/test_fsdp2_engine.py), so the matrix's unsharded stage-3 cases are skipped.
"""
import logging
import math

import pytest
import torch
from pydantic import ValidationError

import zenflow
import zenflow as deepspeed  # the one changed line of a DeepSpeed test
from zenflow import comm as dist
from zenflow import get_accelerator
from zenflow.config.deepspeed_json import ConfigError, parse_config
from zenflow.config.zero_sections import OffloadOptimizerSection, ZenFlowSection, ZeroSection

STAGE3 = ("ZeRO stage 3 maps onto FSDP2: the model must be wrapped with fully_shard before "
          "initialize (tests/test_fsdp2_engine.py); these cases hand an unsharded model")


# ----------------------------------------------------------------------------------------------
# DeepSpeed's test fixtures (tests/unit/simple_model.py), as small as theirs.

class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim, nlayers=1):
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


def random_dataloader(model, total_samples, hidden_dim, device, dtype):
    batch_size = model.train_micro_batch_size_per_gpu()
    train_data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    dataset = torch.utils.data.TensorDataset(train_data, train_label)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


# ----------------------------------------------------------------------------------------------
# DeepSpeed's schedule, from its code.

def deepspeed_schedule(steps, select_strategy, select_interval, update_interval, warm_up,
                       steps_per_epoch=None):
    """(selection steps, window-end steps) that DeepSpeed's ZenFlow gives over `steps` steps
    with a fixed update_interval: configure_zenflow resolves the interval ("auto" is "epoch" with
    1; an epoch without a dataloader is 0, select once), is_zenflow_select_boundary selects at
    the first step after warm-up and at every multiple of the interval, and
    is_zenflow_update_boundary ends a window at every update_interval-th step after warm-up and
    at the step before each multiple of the select interval."""
    every = 1 if select_strategy == "auto" else select_interval
    if select_strategy in ("auto", "epoch"):
        every = every * steps_per_epoch if steps_per_epoch else 0
    selects = [t for t in range(steps) if t - warm_up >= 0
               and (t == warm_up or (every and t % every == 0))]
    ends = [t for t in range(steps)
            if t + 1 < warm_up or (t + 1 - warm_up) % update_interval == 0
            or (every and (t + 1) % every == 0)]
    return selects, ends


def our_schedule(decisions):
    selects = [t for t, kind in decisions if kind in ("select", "reselect")]
    ends = [t for t, kind in decisions if kind == "flush"]
    return selects, ends


def window_lengths(ends, warm_up):
    starts = [warm_up - 1] + [t for t in ends if t >= warm_up][:-1]
    return [b - a for a, b in zip(starts, [t for t in ends if t >= warm_up])]


# ----------------------------------------------------------------------------------------------
# test_zf.py: the engine matrix.

HIDDEN_DIM, BATCH_SIZE, TOTAL_SAMPLES = 10, 4, 20
STRATEGIES = [("auto", "auto", "auto"), ("step", 10, 3), ("epoch", 1, 4)]


def get_config_dict(stage, offload_selective_optimizer, select_strategy, select_interval,
                    update_interval, full_warm_up_rounds, grad_acc_steps=1):
    config = {
        "train_batch_size": BATCH_SIZE,
        "gradient_accumulation_steps": grad_acc_steps,
        "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "cpu"},
            "overlap_comm": True,
            "zenflow": {
                "topk_ratio": 0.2,
                "select_strategy": select_strategy,
                "select_interval": select_interval,
                "update_interval": update_interval,
                "overlap_step": False,
                "offload": offload_selective_optimizer,
                "auto_ratio": 0.99,
                "full_warm_up_rounds": full_warm_up_rounds,
            },
        },
        "zero_allow_untested_optimizer": True,
    }
    if get_accelerator().is_bf16_supported():
        config["bf16"] = {"enabled": True}
    return config


def run_training_distributed(config_dict):
    """DeepSpeed's run_training_distributed, recording what the assertions need."""
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zenflow").addHandler(handler)
    try:
        torch.manual_seed(0)
        model = SimpleModel(HIDDEN_DIM)
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        model, optimizer, _, _ = deepspeed.initialize(model=model,
                                                      model_parameters=model.parameters(),
                                                      config=config_dict)
        dtype = next(model.module.parameters()).dtype
        train_dataloader = random_dataloader(model=model, total_samples=TOTAL_SAMPLES,
                                             hidden_dim=HIDDEN_DIM, device=model.device,
                                             dtype=dtype)
        dist.barrier()
        losses = []
        for step, batch in enumerate(train_dataloader):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            losses.append(loss.item())
        model.synchronize()
        result = {"losses": losses, "global_steps": model.global_steps,
                  "decisions": list(optimizer.decisions), "dtype": dtype,
                  "before": before, "update_interval": optimizer.settings.update_interval,
                  "bounds": optimizer.settings.auto_update_bounds,
                  "after": {n: p.detach().float().clone()
                            for n, p in model.module.named_parameters()}}
        model.destroy()
    finally:
        logging.getLogger("zenflow").removeHandler(handler)
    result["warnings"] = warnings
    return result


def check_run(result, steps, select_strategy, select_interval, update_interval, warm_up):
    assert result["global_steps"] == steps
    assert len(result["losses"]) == steps and all(math.isfinite(x) for x in result["losses"])
    assert result["dtype"] == (torch.bfloat16 if get_accelerator().is_bf16_supported()
                               else torch.float32)
    assert any(not torch.equal(result["before"][n], result["after"][n]) for n in result["after"])
    selects, ends = our_schedule(result["decisions"])
    if update_interval == "auto":
        # Deliberate: our "auto" window rule is not DeepSpeed's (docs/semantics.md: DeepSpeed's
        # criterion never fires in its current code and is only right for topk_ratio 0.1); the
        # windows stay in their bounds and the selection is DeepSpeed's.
        ds_selects, _ = deepspeed_schedule(steps, select_strategy, select_interval, 1, warm_up)
        low, high = result["bounds"]
        assert all(low <= n <= high for n in window_lengths(ends, warm_up)[:-1]), ends
    else:
        ds_selects, ds_ends = deepspeed_schedule(steps, select_strategy, select_interval,
                                                 update_interval, warm_up)
        assert ends == ds_ends, (ends, ds_ends)
    assert selects == ds_selects == [warm_up]
    if select_strategy in ("auto", "epoch"):
        # No dataloader went to initialize, so no epoch length: DeepSpeed selects once, silently;
        # we select once and say so.
        assert any("selected once and kept" in w for w in result["warnings"]), result["warnings"]


MATRIX = [(stage, warm_up, offload, strategy) for stage in (1, 2, 3) for warm_up in (0, 3)
          for offload in (True, False) for strategy in STRATEGIES]


def _ids(case):
    stage, warm_up, offload, (s, i, u) = case
    return f"stage{stage}-warmup{warm_up}-offload{offload}-{s}-{i}-{u}"


@pytest.mark.parametrize("case", MATRIX, ids=[_ids(c) for c in MATRIX])
def test_zenflow_single_gpu(case):
    stage, warm_up, offload, (select_strategy, select_interval, update_interval) = case
    config_dict = get_config_dict(stage, offload, select_strategy, select_interval,
                                  update_interval, warm_up)
    if stage == 3:
        with pytest.raises(ConfigError, match="stage is 3 .* not sharded: call .*fully_shard"):
            deepspeed.initialize(model=SimpleModel(HIDDEN_DIM), config=config_dict)
        pytest.skip(STAGE3)
    result = run_training_distributed(config_dict)
    check_run(result, TOTAL_SAMPLES // BATCH_SIZE, select_strategy, select_interval,
              update_interval, warm_up)


def _distributed_rank(rank, world, port, out_dir, cases):
    """Every non-stage-3 case of the matrix, one after another, in one 2-rank gloo group (one
    spawn instead of 24 keeps the suite fast on a small machine)."""
    import os
    from datetime import timedelta

    import torch.distributed as tdist
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=timedelta(seconds=60))
    results = {}
    for case in cases:
        stage, warm_up, offload, (select_strategy, select_interval, update_interval) = case
        try:
            results[_ids(case)] = run_training_distributed(get_config_dict(
                stage, offload, select_strategy, select_interval, update_interval, warm_up))
        except Exception as exc:   # reported by the case's own test
            results[_ids(case)] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    from helpers.spawn import spawn_ranks
    out = tmp_path_factory.mktemp("zf_distributed")
    cases = [c for c in MATRIX if c[0] != 3]
    return spawn_ranks(_distributed_rank, (str(out), cases), out, world=2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=[_ids(c) for c in MATRIX])
def test_zenflow_distributed(case, request):
    stage, warm_up, offload, (select_strategy, select_interval, update_interval) = case
    if stage == 3:
        pytest.skip(STAGE3)
    ranks = request.getfixturevalue("distributed_results")
    results = [r[_ids(case)] for r in ranks]
    for r in results:
        assert "error" not in r, r.get("error")
    # train_batch_size 4 over 2 ranks: micro-batches of 2, and each rank reads all 20 samples
    # (DeepSpeed's random_dataloader has no sampler): 10 steps.
    steps = TOTAL_SAMPLES // (BATCH_SIZE // 2)
    for r in results:
        check_run(r, steps, select_strategy, select_interval, update_interval, warm_up)
    assert results[0]["decisions"] == results[1]["decisions"]
    for name, value in results[0]["after"].items():
        assert torch.equal(value, results[1]["after"][name]), name


# test_split_affinity: DeepSpeed's _split_affinity(cores, perc) -> (worker cores, training
# cores); ours is zenflow.host.cores.split_cores(perc, cores) -> (training, worker). The CPUs
# are taken as given (one core each), as DeepSpeed's function takes them.
SPLITS = [
    ([0, 1, 2, 3, 4, 5, 6, 7], 0.25, [2, 3, 4, 5, 6, 7], [0, 1]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 0.1, [1, 2, 3, 4, 5, 6, 7], [0]),
    ([10, 11], 0.5, [11], [10]),
    # Deliberate: DeepSpeed shares every core between both sides when the reserve rounds to 0
    # or to every core; we always give each side at least one core of its own (the worker's
    # AdamW and the training threads contending for one set of cores is the stall ZenFlow is
    # there to remove).
    ([0, 1, 2, 3], 0.0, [1, 2, 3], [0]),
    ([0, 1, 2, 3], 1.0, [3], [0, 1, 2]),
]


@pytest.mark.parametrize("cores,perc,expected_zf,expected_pt", SPLITS)
def test_split_affinity(cores, perc, expected_zf, expected_pt, monkeypatch):
    from zenflow.host import cores as core_split
    monkeypatch.setattr(core_split, "_physical_cores", lambda cpus: [[c] for c in cpus])
    pt, zf = core_split.split_cores(perc, cores)
    assert zf == expected_zf
    assert pt == expected_pt
    # When the sides are actually isolated they must partition the cores exactly.
    if zf != pt:
        assert sorted(zf + pt) == sorted(cores)
        assert not (set(zf) & set(pt))


# ----------------------------------------------------------------------------------------------
# test_zf_config.py: the config blocks.

def test_stage_enum_accepts_int_and_enum():
    """`stage` can be passed as an int; DeepSpeed's ZeroStageEnum is an IntEnum of the same
    numbers."""
    import enum

    class ZeroStageEnum(enum.IntEnum):   # DeepSpeed's, for a client that passes one
        disabled, optimizer_states, gradients, weights = 0, 1, 2, 3

    c1 = ZeroSection(stage=2)
    assert c1.stage == ZeroStageEnum.gradients
    c2 = ZeroSection(stage=ZeroStageEnum.optimizer_states)
    assert c2.stage == ZeroStageEnum.optimizer_states
    c3 = ZeroSection(stage=ZeroStageEnum.weights)    # stage 3: FSDP2 here (docs/fsdp2.md)
    assert c3.stage == ZeroStageEnum.weights


def test_offload_optimizer_config_from_dict():
    """A dict for offload_optimizer becomes the offload_optimizer block."""
    cfg = ZeroSection(offload_optimizer={"device": "cpu", "pin_memory": True})
    assert isinstance(cfg.offload_optimizer, OffloadOptimizerSection)
    assert cfg.offload_optimizer.device == "cpu"
    assert cfg.offload_optimizer.pin_memory is True


def test_invalid_offload_optimizer_type_raises():
    """A non-dict offload_optimizer is an error (in a config file: naming the key)."""
    with pytest.raises(ValidationError):
        ZeroSection(offload_optimizer="not a dict")
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer must be an object"):
        parse_config({"train_batch_size": 4, "zero_optimization": {
            "offload_optimizer": "not a dict"}}, world_size=1)


ZENFLOW_PAYLOAD = {"topk_ratio": 0.25, "select_strategy": "auto", "select_interval": 4,
                   "update_interval": 8, "full_warm_up_rounds": 1, "overlap_step": True}


def test_zenflow_config_from_dict():
    """A dict for zenflow becomes the zenflow block."""
    # Deliberate: DeepSpeed's config model accepts select_strategy "auto" with select_interval
    # 4, and its initialize then raises (`raise Warning(...)`: "auto" reselects once per epoch,
    # the 4 "would be overwritten"). We refuse it where the key is read, naming both keys.
    with pytest.raises(ValidationError, match='must be "auto" when select_strategy is "auto"'):
        ZeroSection(zenflow=ZENFLOW_PAYLOAD)
    with pytest.raises(ConfigError, match="zero_optimization.zenflow.select_interval must be "
                                          '"auto" when select_strategy is "auto"'):
        parse_config({"train_batch_size": 4, "zero_optimization": {"zenflow": ZENFLOW_PAYLOAD}},
                     world_size=1)
    # The rest of DeepSpeed's assertions, with the pair DeepSpeed runs ("step", 4).
    cfg = ZeroSection(zenflow=dict(ZENFLOW_PAYLOAD, select_strategy="step"))
    assert isinstance(cfg.zenflow, ZenFlowSection)
    assert cfg.zenflow.topk_ratio == 0.25
    assert cfg.zenflow.select_strategy == "step"
    assert cfg.zenflow.select_interval == 4
    assert cfg.zenflow.update_interval == 8
    assert cfg.zenflow.full_warm_up_rounds == 1
    assert cfg.zenflow.overlap_step is True
    # and with DeepSpeed's "auto" as it runs: select_interval "auto"
    cfg = ZeroSection(zenflow=dict(ZENFLOW_PAYLOAD, select_interval="auto"))
    assert cfg.zenflow.select_strategy == "auto" and cfg.zenflow.select_interval == "auto"


def test_invalid_zenflow_type_raises():
    """A non-dict zenflow is an error."""
    with pytest.raises(ValidationError):
        ZeroSection(zenflow=123)


def test_offload_and_zenflow_combined():
    """offload_optimizer and zenflow together under stage 2, without validation errors."""
    payload = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "zenflow": {"topk_ratio": 0.3, "select_strategy": "epoch", "select_interval": 3,
                    "update_interval": 6, "full_warm_up_rounds": 0, "overlap_step": False},
    }
    cfg = ZeroSection(**payload)
    assert isinstance(cfg.offload_optimizer, OffloadOptimizerSection)
    assert cfg.offload_optimizer.device == "cpu"
    assert isinstance(cfg.zenflow, ZenFlowSection)
    assert cfg.zenflow.select_strategy == "epoch"


@pytest.mark.parametrize("key,value,accepted", [
    # zenflow_config.py: topk_ratio and auto_ratio are Field(ge=0.0, le=1.0)
    ("topk_ratio", 0.0, True), ("topk_ratio", 1.0, True), ("topk_ratio", -0.01, False),
    ("topk_ratio", 1.01, False),
    ("auto_ratio", 0.0, True), ("auto_ratio", 1.0, True), ("auto_ratio", -0.01, False),
    ("auto_ratio", 1.01, False),
    ("pt_reserved_cores_perc", 0.0, True), ("pt_reserved_cores_perc", 1.01, False),
    # select_strategy: one of "auto", "step", "epoch" (and our "drift")
    ("select_strategy", "epoch", True), ("select_strategy", "random", False),
])
def test_zenflow_config_bounds_are_deepspeeds(key, value, accepted):
    block = {"select_strategy": "epoch", "select_interval": 1} if key == "select_strategy" else {}
    block[key] = value
    config = {"train_batch_size": 4, "zero_optimization": {"zenflow": block}}
    if accepted:
        assert getattr(parse_config(config, world_size=1).zenflow, key) == value
    else:
        with pytest.raises(ConfigError, match=f"zero_optimization.zenflow.{key} must be "):
            parse_config(config, world_size=1)


# ----------------------------------------------------------------------------------------------
# The select interval: DeepSpeed's schedule.

def _train(opt, params, steps, hot=lambda t: (t // 7) % 3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            if p.ndim == 2:
                g[:, hot(t) * 3] *= 30   # the important column moves: reselections move state
            p.grad = g
        opt.step()


@pytest.mark.parametrize("select_interval,update_interval,warm_up,overlap", [
    (10, 4, 0, False), (10, 4, 0, True), (10, 3, 3, False), (6, 4, 2, True), (4, 4, 0, False),
    (3, 5, 0, False),
])
def test_step_strategy_reselects_every_n_steps_whatever_the_windows(
        select_interval, update_interval, warm_up, overlap):
    """("step", N) selects at every multiple of N (DeepSpeed: 0, 10, 20, 30 for N=10 with
    update_interval 4), and a window ends the step before each."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 12)), torch.nn.Parameter(torch.randn(6))]
    steps = 36
    with zenflow.ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, select_strategy="step",
                              select_interval=select_interval, update_interval=update_interval,
                              full_warm_up_rounds=warm_up, overlap_step=overlap,
                              worker=False) as opt:
        _train(opt, params, steps)
        selects, ends = our_schedule(opt.decisions)
    ds_selects, ds_ends = deepspeed_schedule(steps, "step", select_interval, update_interval,
                                             warm_up)
    assert selects == ds_selects
    if (select_interval, warm_up) == (10, 0):
        assert selects == [0, 10, 20, 30]
    assert opt.num_reselections == len(selects) - 1
    assert all(t - 1 in ends for t in selects if t > warm_up)
    assert all(n <= update_interval for n in window_lengths(ends, warm_up))
    # Deliberate: after a reselection's cut, our windows count update_interval steps afresh
    # (DeepSpeed keeps its grid, (t + 1 - warm_up) % update_interval); up to the first cut, and
    # whenever the interval is a multiple of update_interval past warm-up, they are the same.
    first_cut = next((t for t in selects if t > warm_up), steps)
    assert [t for t in ends if t < first_cut] == [t for t in ds_ends if t < first_cut]
    if select_interval % update_interval == 0 and warm_up == 0:
        assert ends == ds_ends


def test_step_strategy_reselects_with_auto_windows_too():
    """With update_interval "auto" the reselection still comes every N steps."""
    params = [torch.nn.Parameter(torch.randn(6, 12))]
    with zenflow.ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, select_strategy="step",
                              select_interval=5, update_interval="auto", auto_ratio=0.99,
                              auto_update_bounds=(3, 16), overlap_step=False,
                              worker=False) as opt:
        _train(opt, params, 30)
        selects, ends = our_schedule(opt.decisions)
    assert selects == [0, 5, 10, 15, 20, 25]
    assert all(t - 1 in ends for t in selects[1:])


@pytest.mark.parametrize("strategy,interval,steps_per_epoch,expected", [
    ("epoch", 2, 5, [0, 10, 20]),
    ("auto", "auto", 6, [0, 6, 12, 18, 24]),       # DeepSpeed's "auto": once per epoch
])
def test_epoch_and_auto_reselect_once_per_epochs(strategy, interval, steps_per_epoch, expected):
    params = [torch.nn.Parameter(torch.randn(6, 12))]
    with zenflow.ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, select_strategy=strategy,
                              select_interval=interval, steps_per_epoch=steps_per_epoch,
                              update_interval=4, overlap_step=True, worker=False) as opt:
        _train(opt, params, 28)
        selects, _ = our_schedule(opt.decisions)
    assert selects == expected
    assert selects == deepspeed_schedule(28, strategy, interval, 4, 0, steps_per_epoch)[0]


@pytest.mark.parametrize("strategy,interval", [("epoch", 1), ("auto", "auto")])
def test_epoch_without_an_epoch_length_selects_once_and_warns(strategy, interval, caplog):
    params = [torch.nn.Parameter(torch.randn(6, 12))]
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        opt = zenflow.ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, select_strategy=strategy,
                                   select_interval=interval, update_interval=2, worker=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f'select_strategy="{strategy}"' in warned[0]
    assert "selected once and kept" in warned[0] and "steps_per_epoch" in warned[0]
    with opt:
        _train(opt, params, 40)   # the important column moves, and no one looks
        selects, ends = our_schedule(opt.decisions)
    assert selects == [0] and opt.num_reselections == 0 and len(ends) == 20


def test_drift_is_ours_and_reselects_when_the_selection_drifts():
    """select_strategy "drift" (the constructor's default) keeps our rule: reselect once the
    selection holds less than reselect_threshold of the best columns' importance."""
    params = [torch.nn.Parameter(torch.randn(6, 12))]
    with zenflow.ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, update_interval=2,
                              worker=False) as opt:
        assert opt.settings.select_strategy == "drift"
        _train(opt, params, 40, hot=lambda t: 0 if t < 8 else 2)   # checks back off: 40 steps
    reselections = [t for t, kind in opt.decisions if kind == "reselect"]
    assert reselections and all(t >= 8 for t in reselections)


def test_engine_auto_selection_takes_the_epoch_from_training_data():
    """DeepSpeed's default "auto" under initialize(training_data=...): once per epoch."""
    config = get_config_dict(2, False, "auto", "auto", 2, 0)
    config.pop("bf16", None)
    data = torch.utils.data.TensorDataset(torch.randn(24, HIDDEN_DIM),
                                          torch.randint(0, HIDDEN_DIM, (24,)))
    engine, optimizer, loader, _ = deepspeed.initialize(model=SimpleModel(HIDDEN_DIM),
                                                        config=config, training_data=data)
    assert optimizer.settings.steps_per_epoch == len(loader) == 6
    for _epoch in range(3):
        for x, y in loader:
            engine.backward(engine(x, y))
            engine.step()
    selects, _ = our_schedule(optimizer.decisions)
    engine.destroy()
    assert selects == [0, 6, 12]


# ----------------------------------------------------------------------------------------------
# test_zf_torch_adam.py: what a client can see of the selective optimizer. DeepSpeed's tests
# drive ZenFlowSelectiveAdamW's internals (selected_indices, selected_grad and
# temp_selected_param set on the parameters by hand, group_step, bucket flushes, NVMe swaps);
# ours has none of those. The port asserts the same facts through the public optimizer: the
# selected columns move, 1-D parameters move, the moments and step count are there to read
# (state_dict()["state"], keys "step", "exp_avg", "exp_avg_sq"), and all columns selected is
# AdamW. DeepSpeed's stage-3 variants (ZenFlowSelectiveAdamW_stage3) drive its internals by hand.

def _matrix_step(**knobs):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = zenflow.ZenFlowAdamW([param], lr=1e-3, topk_ratio=0.5, update_interval=4,
                               select_strategy="step", select_interval=1000, worker=False,
                               **knobs)
    return param, opt


@pytest.mark.parametrize("offload", [True, False])
def test_init_methods(offload):
    # DeepSpeed's `offload` picks the step method (selected moments on the host or not). Ours
    # keeps the selected columns' state on the device; the JSON key is accepted with no effect,
    # so both values build the same optimizer.
    config = get_config_dict(2, offload, "step", 10, 3, 0)
    config.pop("bf16", None)
    model = SimpleModel(HIDDEN_DIM)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    assert isinstance(optimizer, zenflow.ZenFlowAdamW)
    assert "zero_optimization.zenflow.offload" in engine.config.ignored_keys()
    engine.destroy()


def test_step_without_offload():
    param, opt = _matrix_step()
    with opt:
        param.grad = torch.randn(4, 6)
        before = param.detach().clone()
        opt.step()
        selected = opt.state_dict()["state"][0]["device"]["column_indices"]
    assert len(selected) == 3
    diff_norm = (before[:, selected] - param.detach()[:, selected]).abs().sum().item()
    assert diff_norm > 1e-5, "param was not updated"
    # the deferred columns wait for the window's end (update_interval 4)
    deferred = [j for j in range(6) if j not in selected.tolist()]
    assert torch.equal(before[:, deferred], param.detach()[:, deferred])


def test_clear_selected_mv():
    # Deliberate: DeepSpeed zeroes the selected columns' moments at every selection
    # (clear_selected_mv); ours move with their column, rescaled so that the bias-corrected
    # values are unchanged (docs/semantics.md, "State moves with its column").
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 6))
    hot = torch.tensor([1.0, 1.0, 1.0, 0.01, 0.01, 0.01])   # columns 0-2 stay the important ones
    with zenflow.ZenFlowAdamW([param], lr=1e-3, topk_ratio=0.5, update_interval=1,
                              select_strategy="step", select_interval=2, worker=False) as opt:
        for _ in range(2):
            param.grad = torch.randn(4, 6) * hot
            opt.step()
        state = opt.state_dict()["state"][0]["device"]
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(state)
        assert state["column_indices"].tolist() == [0, 1, 2]
        assert state["exp_avg"].abs().sum() > 0
        kept = state["exp_avg"].clone()
        param.grad = torch.zeros(4, 6)
        param.grad[:, :3] = 1e-30    # still the most important columns, and next to nothing
        opt.step()   # step 2 reselects (the same columns): their moments are not cleared
        state = opt.state_dict()["state"][0]["device"]
        assert opt.num_reselections == 1 and state["column_indices"].tolist() == [0, 1, 2]
    torch.testing.assert_close(state["exp_avg"], kept * 0.9)


def test_1d_param_support():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(10))
    twin = torch.nn.Parameter(param.detach().clone())
    with zenflow.ZenFlowAdamW([param], lr=1e-3, worker=False) as opt:
        reference = torch.optim.AdamW([twin], lr=1e-3)
        for _ in range(3):
            g = torch.randn(10)
            param.grad, twin.grad = g.clone(), g.clone()
            opt.step()
            reference.step()
            state = opt.state_dict()["state"][0]
        torch.testing.assert_close(param.detach(), twin.detach(), rtol=1e-6, atol=1e-7)
    assert state["step"] == 3
    torch.testing.assert_close(state["exp_avg"], reference.state[twin]["exp_avg"],
                               rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(state["exp_avg_sq"], reference.state[twin]["exp_avg_sq"],
                               rtol=1e-6, atol=1e-10)


def test_state_increment():
    param, opt = _matrix_step()
    with opt:
        param.grad = torch.randn(4, 6)
        opt.step()
        step1 = opt.state_dict()["state"][0]["device"]["step"]
        param.grad = torch.randn(4, 6)
        opt.step()
        step2 = opt.state_dict()["state"][0]["device"]["step"]
    assert step2 == step1 + 1
    # Deliberate: torch's own `opt.state[param]` holds no moments, only where they live (so
    # that torch.distributed.checkpoint never runs a step to fill it); the state lives in the
    # host arena and on the device in our layout, and state_dict() is where a client reads it
    # (a full per-parameter copy behind `opt.state` would copy the whole host state whenever a
    # framework walks optimizer.state, as Lightning does to move it between devices).
    assert opt.state[param] == {"kind": "host"}


def test_against_torch_adamw():
    """Every column selected is torch.optim.AdamW (DeepSpeed: atol 1e-4; fp32 here: 1e-6)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(2, 4))
    torch_param = torch.nn.Parameter(param.detach().clone())
    with zenflow.ZenFlowAdamW([param], lr=1e-3, topk_ratio=1.0, update_interval=3,
                              worker=False) as opt:
        torch_opt = torch.optim.AdamW([torch_param], lr=opt.param_groups[0]["lr"])
        for _ in range(10):
            grad = torch.randn_like(param)
            param.grad, torch_param.grad = grad.clone(), grad.clone()
            opt.step()
            torch_opt.step()
    torch.testing.assert_close(param.detach(), torch_param.detach(), rtol=1e-6, atol=1e-7)
