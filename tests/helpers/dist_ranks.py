"""Code that runs inside the multi-process tests (spawned ranks, gloo on 127.0.0.1)."""
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import zenflow

from helpers.models import make_mlp

GLOBAL_BATCH = 12   # splits evenly over 1, 2, 3 and 4 ranks


def batch(step: int):
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def optimizer_kwargs(overlap: bool, moments: bool = False) -> dict:
    """`moments`: every window sum on the (CPU) device, so deferred_credit "moments" applies."""
    return dict(lr=3e-3, topk_ratio=0.2, update_interval=3, overlap_step=overlap,
                select_strategy="step", select_interval=4, max_grad_norm=5.0,
                **(dict(deferred_credit="moments", device_sum_budget=1 << 40) if moments else {}))


def engine_config(overlap: bool, world: int = 2, update_interval=3) -> dict:
    kw = optimizer_kwargs(overlap)
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_clipping": kw["max_grad_norm"],
            "optimizer": {"type": "AdamW", "params": {"lr": kw["lr"], "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"topk_ratio": kw["topk_ratio"],
                                              "update_interval": update_interval,
                                              "select_strategy": "step", "select_interval": 4,
                                              "overlap_step": overlap}}}


def train_single_process(steps: int, overlap: bool, moments: bool = False):
    """(model, optimizer) after `steps` steps of one process on the whole global batch."""
    model = make_mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), weight_decay=0.01, worker=False,
                               **optimizer_kwargs(overlap, moments))
    for t in range(steps):
        x, y = batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def single_process_run(steps: int, overlap: bool, synchronized: bool = False) -> dict:
    """The reference: one process, the whole global batch each step; `synchronized`: with the
    update in flight installed, as the engine's state_dict() reads the weights."""
    model, opt = train_single_process(steps, overlap)
    if synchronized:
        opt.synchronize()
    stats = opt.stats()
    weights = {k: v.clone() for k, v in model.state_dict().items()}   # before close() installs
    opt.close()
    return {"weights": weights,
            "host_bytes": stats["host_bytes"], "d2h_bytes": stats["d2h_bytes_total"],
            "reselections": stats["reselections"]}


EVAL_EVERY = 5


def _raw(module) -> dict:
    """The weights as they are (named_parameters() is not hooked; state_dict() installs)."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def single_process_eval_run(steps: int) -> list[dict]:
    """The reference for the evaluation loop: every EVAL_EVERY steps, the synchronized weights."""
    model = make_mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), weight_decay=0.01, worker=False,
                               **optimizer_kwargs(True))
    seen = []
    for t in range(steps):
        x, y = batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if t % EVAL_EVERY == EVAL_EVERY - 1:
            opt.synchronize()
            seen.append(_raw(model))
    opt.close()
    return seen


def _eval_loop(rank, world, steps, result):
    """A DeepSpeed client's `model.eval(); evaluate(); model.train()` on every rank, then an
    evaluation on rank 0 alone, which must neither hang nor let the ranks drift apart."""
    import logging
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zenflow.engine").addHandler(handler)
    engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(True, world))
    result["evals"], result["before_eval"] = [], []
    for t in range(steps):
        x, y = my_share(t, rank, world)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        if t % EVAL_EVERY == EVAL_EVERY - 1:
            result["before_eval"].append(_raw(engine.module))
            engine.eval()
            with torch.no_grad():
                engine(x)
            result["evals"].append(_raw(engine.module))
            engine.train()
    for t in range(steps, steps + 3):
        if t == steps + 1 and rank == 0:   # rank 0 alone evaluates while rank 1 trains on
            with torch.no_grad():
                engine(x)
        x, y = my_share(t, rank, world)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    result["after"] = _raw(engine.module)
    result["warnings"] = warnings
    engine.close()


def _checkpoint_calls(rank, world, out_dir, result):
    """save_checkpoint as clients call it: tags that differ per rank, then on rank 0 only."""
    import logging
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zenflow.engine").addHandler(handler)
    engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(True, world))
    ckpt = os.path.join(out_dir, "ckpt")
    _train_engine(engine, 2)
    result["path"] = engine.save_checkpoint(ckpt, tag=f"loss{rank}.5")  # DeepSpeed's tutorial
    result["warnings"] = list(warnings)
    engine.config.checkpoint.tag_validation = "FAIL"
    try:
        engine.save_checkpoint(ckpt, tag=f"other{rank}")
    except ValueError as exc:
        result["fail_error"] = str(exc)
    _train_engine(engine, 4, start=2)
    if rank == 0:
        try:
            engine.save_checkpoint(ckpt, tag="rank0_only")
        except RuntimeError as exc:
            result["lone_save_error"] = str(exc)
        engine.close()
        return
    _train_engine(engine, 5, start=4)   # rank 0 never joins this step: it fails, rank 0 is gone


def _eval_alone_while_others_wait(rank, world, out_dir, result):
    """Evaluation on rank 0 only while the other ranks wait in a barrier of the served
    deepspeed.comm (DeepSpeed's `if rank == 0: evaluate()` then `dist.barrier()`), or in
    save_checkpoint; then the way to evaluate current weights on one rank: engine.eval() on every
    rank first."""
    import logging
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zenflow.engine").addHandler(handler)
    engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(True, world))
    x, _ = my_share(0, rank, world)

    def evaluate_alone(name: str) -> None:
        if rank == 0:
            start = time.monotonic()
            with torch.no_grad():
                engine(x)
            result[name] = time.monotonic() - start

    _train_engine(engine, 3)
    evaluate_alone("beside_a_barrier_s")
    zenflow.comm.barrier()
    _train_engine(engine, 5, start=3)
    evaluate_alone("beside_a_save_s")
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    _train_engine(engine, 7, start=5)
    engine.eval()                      # every rank: installs the update in flight
    result["synchronized"] = _raw(engine.module)
    evaluate_alone("after_eval_on_every_rank_s")
    engine.train()
    zenflow.comm.barrier()
    _train_engine(engine, 8, start=7)
    result["after"] = _raw(engine.module)
    result["warnings"] = warnings
    engine.close()


def _save_after_a_rank_exits(rank, world, out_dir, result):
    """DeepSpeed-ZenFlow's finetune_llama.py: every rank trains, then only rank 0 saves, and the
    other ranks' scripts end. Rank 0's save must learn that they are gone, and say so."""
    engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(True, world))
    _train_engine(engine, 2)
    if rank != 0:
        return   # the script ends: the process exits without calling save_checkpoint
    start = time.monotonic()
    try:
        engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    except RuntimeError as exc:
        result["save_error"] = str(exc)
    result["save_s"] = time.monotonic() - start
    engine.close()


def my_share(t: int, rank: int, world: int):
    x, y = batch(t)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_share(model, opt, start: int, stop: int, rank: int, world: int) -> None:
    """Steps start..stop-1 of a bare optimizer, each rank on its share of the global batch."""
    for t in range(start, stop):
        x, y = my_share(t, rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def adamw_on_the_whole_batch(steps: int) -> dict:
    """The MLP's weights after `steps` steps of torch's AdamW with gradient clipping, one
    process on the whole batch, at optimizer_kwargs' settings (weight decay 0.01): what one-step
    windows without overlap equal."""
    model = make_mlp()
    kw = optimizer_kwargs(False)
    adamw = torch.optim.AdamW(model.parameters(), lr=kw["lr"], weight_decay=0.01)
    for t in range(steps):
        x, y = batch(t)
        adamw.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
        adamw.step()
    return model.state_dict()


def _train_engine(engine, steps, start=0):
    for t in range(start, steps):
        x, y = my_share(t, dist.get_rank(), dist.get_world_size())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def _weights(module) -> dict:
    return {k.removeprefix("module."): v.detach().clone() for k, v in module.state_dict().items()}


def _ddp(rank, world, overlap, steps, worker, result):
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    opt = zenflow.ZenFlowAdamW(model.parameters(), weight_decay=0.01, worker=worker,
                               **optimizer_kwargs(overlap))
    for t in range(steps):
        x, y = my_share(t, rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    state = opt.state_dict()
    stats = opt.stats()
    result["host_rows"] = [s["host"]["master"].shape[0] for s in state["state"].values()
                           if s["kind"] == "host"]
    result["host_bytes"] = stats["host_bytes"]
    result["d2h_bytes"] = stats["d2h_bytes_total"]
    result["reselections"] = stats["reselections"]
    result["collective_bytes_sent"] = stats["collective_bytes_sent"]
    result["weights"] = _weights(model)
    opt.close()


def _ddp_defaults(rank, world, steps, result):
    """ZenFlowAdamW's own defaults: each rank's host paces the windows; the ranks must agree."""
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    with zenflow.ZenFlowAdamW(model.parameters(), lr=3e-3) as opt:
        for t in range(steps):
            x, y = my_share(t, rank, world)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.synchronize()
        result["decisions"] = list(opt.decisions)
        result["weights"] = _weights(model)


def _checked(rank, world, overlap, steps, out_dir, options, result):
    """The engine under intercepted collectives with a declared backend (collective_check.py):
    selection, reselection with handoff, windows, installs, a checkpoint and a resume."""
    import zenflow.distributed as zd

    from helpers.collective_check import CheckedDist, HostTaint
    taint = HostTaint()
    checked = CheckedDist(dist, options["backend"], torch.device("cpu"), taint)
    zd.dist = checked
    try:   # the intercepted module back as it was, for whatever runs next in this process
        config = engine_config(overlap, world, options.get("update_interval", 3))
        ckpt = os.path.join(out_dir, "ckpt")
        engine, *_ = zenflow.initialize(model=make_mlp(), config=config)
        taint.add_arena(engine.optimizer)
        with taint:
            _train_engine(engine, steps // 2)
            engine.save_checkpoint(ckpt)
            engine.close()
            engine, *_ = zenflow.initialize(model=make_mlp(), config=config)
            taint.ranges = []   # the closed engine's arena is unmapped; the new one replaces it
            taint.add_arena(engine.optimizer)
            engine.load_checkpoint(ckpt)
            _train_engine(engine, steps, start=steps // 2)
            opt = engine.optimizer
            result["purposes"] = sorted(opt.stats()["collective_bytes_sent"])
            result["windows"] = opt.num_windows
            result["reselections"] = opt.num_reselections
            result["weights"] = _weights(engine.module)
            result["violations"] = list(checked.violations)
            result["calls"] = dict(checked.calls)
            # Probes: what the code did before (a host copy for the norms; a host buffer gathered)
            # must be caught, or the check proves nothing.
            part = opt._partition
            part.sum_(torch.ones(4, device=part.device).cpu(), "probe: norms copied to the host")
            part.gather_rows(opt._pipeline.host.fp32("master", 0), 24, "probe: host rows")
            result["probe_violations"] = checked.violations[len(result["violations"]):]
        engine.close()
    finally:
        zd.dist = dist


def _unseeded(rank, world, steps, worker, result):
    """Each rank builds its model from its own seed, as unseeded processes do, with a head of
    one row (fewer rows than ranks): the bare optimizer refuses replicas that differ, and
    initialize starts every rank from rank 0's weights (issue 24, items 1 and 9)."""
    def make():
        torch.manual_seed(100 + rank)
        return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 1))
    try:
        zenflow.ZenFlowAdamW(make().parameters(), worker=False).close()
        result["bare"] = "accepted"
    except ValueError as exc:
        result["bare"] = str(exc)
    config = engine_config(False, world, update_interval=2)
    engine, *_ = zenflow.initialize(model=make(), config=config)
    result["initial"] = _weights(engine.module)
    for t in range(steps):
        x, y = my_share(t, rank, world)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y[:, :1]))
        engine.step()
    engine.synchronize()
    result["weights"] = _weights(engine.module)
    engine.close()


def rank_main(rank: int, world: int, port: int, mode: str, overlap: bool, out_dir: str,
              steps: int, worker: bool, options: dict | None = None):
    options = options or {}
    torch.set_num_threads(1)
    if mode == "torchrun":   # as torchrun launches a script that never calls init_process_group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        if mode == "ddp":
            _ddp(rank, world, overlap, steps, worker, result)
        elif mode == "ddp_defaults":
            _ddp_defaults(rank, world, steps, result)
        elif mode == "checked":
            _checked(rank, world, overlap, steps, out_dir, options, result)
        elif mode == "torchrun":
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world))
            result["backend"] = dist.get_backend()
            _train_engine(engine, steps)
            result["weights"] = _weights(engine.module)
            engine.close()
        elif mode == "engine_resume":   # straight through, then saved halfway and resumed
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world))
            _train_engine(engine, steps)
            result["straight"] = _weights(engine.module)
            engine.close()
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world))
            _train_engine(engine, steps // 2)
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
            engine.close()
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world))
            engine.load_checkpoint(os.path.join(out_dir, "ckpt"))
            _train_engine(engine, steps, start=steps // 2)
            result["weights"] = _weights(engine.module)
            engine.close()
        elif mode == "eval_loop":
            _eval_loop(rank, world, steps, result)
        elif mode == "checkpoint_calls":
            _checkpoint_calls(rank, world, out_dir, result)
        elif mode == "eval_alone_while_others_wait":
            _eval_alone_while_others_wait(rank, world, out_dir, result)
        elif mode == "save_after_a_rank_exits":
            _save_after_a_rank_exits(rank, world, out_dir, result)
        elif mode == "unseeded":
            _unseeded(rank, world, steps, worker, result)
        elif mode == "rank_dies":
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world))
            for t in range(steps):
                if rank == 1 and t == 3:
                    os._exit(17)  # dies without a word, mid-training
                x, y = my_share(t, rank, world)
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
    except Exception as exc:  # reported to the test, which decides what is expected
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if "error" not in result and dist.is_initialized():
        dist.destroy_process_group()
