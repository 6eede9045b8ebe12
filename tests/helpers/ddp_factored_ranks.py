"""Code that runs inside the DDP ranks of deferred_credit="factored" (spawned, gloo on 127.0.0.1),
and the one process they are compared with: zenflow.optim.reference with each matrix's factors
fitted per row block, the ranks' blocks (FSDP2's shards and DDP's host rows split alike)."""
import contextlib
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

from helpers.dist_ranks import batch, optimizer_kwargs, train_share
from helpers.models import make_mlp
from helpers.spawn import ROWS, rows_of, spawn_ranks

STEPS = 20
# Every window sum on the (CPU) device, with room for the factors: every matrix moves.
FACTORED = {"deferred_credit": "factored", "device_sum_budget": 1 << 40}
ADAMW_LIKE = {**FACTORED, "topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}


def per_block_reference(steps: int, world: int) -> tuple[dict, list[list[int]]]:
    """(weights, selected columns) of one process on the whole batch: the reference with each
    matrix's factors fitted per row block of ceil(rows / world) rows (the ranks'), at the ranks'
    settings (optimizer_kwargs with overlap)."""
    model = make_mlp()
    params = list(model.parameters())
    matrices = [i for i, p in enumerate(params) if p.ndim >= 2]
    assert [params[i].shape[0] for i in matrices] == ROWS
    blocks = {i: [rows_of(rank, world)[k] for rank in range(world)]
              for k, i in enumerate(matrices)}
    kw = optimizer_kwargs(True)
    ref = ReferenceZenFlow(params, lr=kw["lr"], weight_decay=0.01, topk_ratio=kw["topk_ratio"],
                           update_interval=kw["update_interval"], overlap_step=True,
                           max_grad_norm=kw["max_grad_norm"], select_interval=kw["select_interval"],
                           deferred_credit="factored", row_blocks=blocks)
    for t in range(steps):
        x, y = batch(t)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        ref.step([p.grad.clone() for p in params])
    chosen = [ref.state[i]["on_device"].nonzero().flatten().tolist() for i in matrices]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, chosen


def _weights(model) -> dict:
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}


def _selections(opt) -> list[list[int]]:
    return [m.selected.column_indices.tolist() for m in opt._host_params]


def _optimizer(model, options, taint=None):
    kwargs = dict(optimizer_kwargs(options.get("overlap", True)), weight_decay=0.01,
                  worker=options.get("worker", False), **options["settings"])
    opt = zenflow.ZenFlowAdamW(model.parameters(), **kwargs)
    if taint is not None:   # a fresh optimizer's arena replaces the closed one's
        taint.ranges = []
        taint.add_arena(opt)
    return opt


@contextlib.contextmanager
def _step_kernels(batch: int | None):
    """With `batch` (options "fused"), the "factored" step takes its kernels as a GPU does
    (factored_kernels.replica_step_, and replica_steps_ in runs of `batch`), run eagerly: the
    op-by-op path's arithmetic, so its bits."""
    if batch is None:
        yield
        return
    from zenflow.host import credit_factored, factored_kernels
    saved = factored_kernels.compiled_for, credit_factored.BATCH
    factored_kernels.compiled_for = (
        lambda fn, device, batch=False: (lambda *args, signature: fn(*args)) if batch else fn)
    credit_factored.BATCH = batch
    try:
        yield
    finally:
        factored_kernels.compiled_for, credit_factored.BATCH = saved


@contextlib.contextmanager
def _gather_in_host_memory(on: bool):
    """With `on` (options "host_gather"), installs gather every rank's rows in host memory
    before the copy, as gloo with a GPU does (optim/installs.gathers_on_device)."""
    from zenflow.optim import installs
    saved = installs.gathers_on_device
    if on:
        installs.gathers_on_device = lambda partition, device: False
    try:
        yield
    finally:
        installs.gathers_on_device = saved


def _bytes_sent_after_copies(opt) -> dict:
    """Counts, by purpose, the collective bytes sent by device work queued after an install's
    copies (to_device's `then`, the copy stream's on a GPU)."""
    transfers, sent = opt._pipeline.transfers, {}
    to_device, bytes_sent = transfers.to_device, opt._partition.bytes_sent

    def counted(pairs, then=None):
        if then is None:
            return to_device(pairs)

        def counted_then():
            before = dict(bytes_sent)
            then()
            for what, n in bytes_sent.items():
                sent[what] = sent.get(what, 0) + n - before.get(what, 0)
        return to_device(pairs, then=counted_then)
    transfers.to_device = counted
    return sent


@contextlib.contextmanager
def _forward_finishes(counted: dict):
    """Counts, in counted["matrices"], the installs an attached forward's pre-hooks finish
    (hooks attached inside the block; they hold the method weakly, so `counted` keeps it)."""
    from zenflow.optim.installs import Installs
    original = Installs.finish_for_forward

    def counting(self, matrices):
        if matrices is not None:
            counted["matrices"] += sum(self.pending([i]) for i in matrices)
        original(self, matrices)
    counted["method"] = Installs.finish_for_forward = counting
    try:
        yield counted
    finally:
        Installs.finish_for_forward = original


def _ddp(rank, world, steps, options, result, taint=None):
    """`steps` steps of the bare optimizer on a DDP-wrapped MLP."""
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    finished_in_forward = {"matrices": 0}
    with _step_kernels(options.get("fused")), _gather_in_host_memory(options.get("host_gather")), \
            _forward_finishes(finished_in_forward):
        opt = _optimizer(model, options, taint)
        after_copies = _bytes_sent_after_copies(opt)
        hooks = opt.attach(model) if options.get("attach") else None
        train_share(model, opt, 0, steps, rank, world)
        weights = _weights(model)   # (attached: its state_dict hook finishes every install)
    if hooks is not None:
        result.update(missed_reads=hooks.missed_reads,
                      finished_in_forward=finished_in_forward["matrices"])
    stats = opt.stats()
    result.update(weights=weights, selections=_selections(opt),
                  windows=stats["windows"], reselections=stats["reselections"],
                  moments_matrices=stats["moments_matrices"], fused_steps=stats["fused_steps"],
                  collective_bytes_sent=stats["collective_bytes_sent"],
                  sent_after_copies=after_copies)
    opt.close()


def _resume(rank, world, steps, options, result, taint=None):
    """`steps` steps straight; and half of them, a save of each rank's own state (the model's
    and the optimizer's), a fresh model and optimizer that load it, the other half."""
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    with _optimizer(model, options, taint) as opt:
        train_share(model, opt, 0, steps, rank, world)
        result["straight"] = _weights(model)
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    with _optimizer(model, options, taint) as opt:
        train_share(model, opt, 0, steps // 2, rank, world)
        saved = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                 "optimizer": opt.state_dict()}
    result["saved_window_steps"] = saved["optimizer"]["zenflow"]["window_steps"]
    result["saved_factors"] = {k: tuple(t.shape) for k, t in
                               saved["optimizer"]["state"][0]["host"].items()
                               if k.endswith("_factors")}
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    with _optimizer(model, options, taint) as opt:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed"] = _weights(model)
        result["purposes"] = sorted(opt.stats()["collective_bytes_sent"])


def _checked(rank, world, steps, options, result):
    """_ddp and _resume with every collective intercepted under a declared backend
    (helpers/collective_check.py): no tensor may reach the group where that backend does not
    take it. A probe that hands the host's factors to the group as they are must be caught."""
    import zenflow.distributed as zd

    from helpers.collective_check import CheckedDist, HostTaint
    taint = HostTaint()
    checked = CheckedDist(zd.dist, options["backend"], torch.device("cpu"), taint)
    real, zd.dist = zd.dist, checked
    try:
        with taint:
            _ddp(rank, world, steps, options, result, taint)
            _resume(rank, world, steps, options, result, taint)
            result["violations"] = list(checked.violations)
            result["calls"] = dict(checked.calls)
            model = torch.nn.parallel.DistributedDataParallel(make_mlp())
            with _optimizer(model, options, taint) as opt:
                train_share(model, opt, 0, 4, rank, world)
                host_alpha = opt._pipeline.host.factors(0)[3]
                opt._partition.gather_stacked(host_alpha, "probe: host factors")
            result["probe_violations"] = checked.violations[len(result["violations"]):]
    finally:
        zd.dist = real


MODES = {"ddp": _ddp, "resume": _resume, "checked": _checked}


def _rank_main(rank: int, world: int, port: int, out_dir: str, steps: int, runs: dict):
    """Several runs in one set of processes (starting ranks is most of a test's time): `runs` is
    {name: (mode, options)}; the result's [name] is that run's."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        for name, (mode, options) in runs.items():
            result[name] = {}
            MODES[mode](rank, world, steps, options, result[name])
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_ddp_factored(tmp_path, runs: dict, world: int = 2, steps: int = STEPS,
                     timeout: float = 300) -> list:
    """`runs` on `world` spawned ranks (the test's side): what each rank wrote."""
    return spawn_ranks(_rank_main, (str(tmp_path), steps, runs), tmp_path, world, timeout)
