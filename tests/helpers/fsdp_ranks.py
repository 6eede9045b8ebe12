"""Code that runs inside the FSDP2 tests (spawned ranks, gloo on 127.0.0.1): the MLP of the DDP
tests, sharded with fully_shard per Linear and at the root, trained by the bare optimizers."""
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import zenflow
from zenflow.distributed import local

from helpers.dist_ranks import my_share, optimizer_kwargs, train_share
from helpers.models import make_mlp
from helpers.spawn import spawn_ranks


def sharded_mlp(mixed_precision: bool = False) -> torch.nn.Module:
    """make_mlp() (the same initial weights on every rank) with fully_shard on each Linear and
    at the root: its parameters are DTensors, Shard(0) on a 1-D mesh."""
    model = make_mlp()
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_weights(model) -> dict:
    """Every parameter whole (all ranks take part: full_tensor() is a collective)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def selections(opt) -> list[list[int]]:
    return [m.selected.column_indices.tolist() for m in opt._host_params]


def _fsdp(rank, world, steps, options, result):
    model = sharded_mlp(options.get("mixed_precision", False))
    cls = zenflow.OffloadAdamW if options.get("offload") else zenflow.ZenFlowAdamW
    kwargs = dict(optimizer_kwargs(options.get("overlap", False), options.get("moments", False)),
                  weight_decay=0.01, worker=options.get("worker", False),
                  **options.get("settings", {}))   # knobs that override the tests' usual ones
    if cls is zenflow.OffloadAdamW:
        kwargs = {k: kwargs[k] for k in ("lr", "weight_decay", "max_grad_norm", "worker")}
    opt = cls(model.parameters(), **kwargs)
    train_share(model, opt, 0, steps, rank, world)
    stats = opt.stats()
    result.update(
        weights=full_weights(model), selections=selections(opt),
        host_rows=[m.local.shape[0] for m in opt._host_params],
        host_bytes=stats["host_bytes"], d2h_bytes=stats["d2h_bytes_total"],
        h2d_bytes=stats["h2d_bytes_total"], reselections=stats["reselections"],
        windows=stats["windows"], skipped=stats["skipped_steps"],
        moments_matrices=stats.get("moments_matrices"),
        collective_bytes_sent=stats["collective_bytes_sent"])
    opt.close()


def single_process_fsdp_reference(steps: int, overlap: bool, moments: bool = False) -> dict:
    """One process, the whole global batch each step, plain tensors (the reference)."""
    from helpers.dist_ranks import train_single_process
    model, opt = train_single_process(steps, overlap, moments)
    stats = opt.stats()
    out = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
           "selections": selections(opt), "host_bytes": stats["host_bytes"],
           "d2h_bytes": stats["d2h_bytes_total"], "h2d_bytes": stats["h2d_bytes_total"],
           "reselections": stats["reselections"], "windows": stats["windows"]}
    opt.close()
    return out


def _refused(rank, world, steps, options, result):
    """Placements other than Shard(0) on a 1-D mesh, and a mix of sharded and plain parameters,
    are refused before any work starts, by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    errors = {}
    for name, placement in (("replicate", Replicate()), ("shard1", Shard(1))):
        p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [placement]))
        try:
            zenflow.ZenFlowAdamW([p], lr=1e-3, worker=False)
        except ValueError as exc:
            errors[name] = str(exc)
    model = sharded_mlp()
    try:
        zenflow.ZenFlowAdamW([*model.parameters(), torch.nn.Parameter(torch.randn(3, 3))],
                             lr=1e-3, worker=False)
    except ValueError as exc:
        errors["mixed"] = str(exc)
    result["errors"] = errors


def _resume(rank, world, steps, options, result):
    """20 steps straight, and 10 steps, a save of each rank's shards (the model's sharded state
    dict and the optimizer's per-rank state), a fresh model and optimizer loading them, 10 more."""
    kwargs = dict(optimizer_kwargs(True), weight_decay=0.01, worker=True,
                  **options.get("settings", {}))
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **kwargs) as opt:
        train_share(model, opt, 0, steps, rank, world)
        result["straight"] = full_weights(model)
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **kwargs) as opt:
        train_share(model, opt, 0, steps // 2, rank, world)
        saved = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                 "optimizer": opt.state_dict()}
        result["saved_window_steps"] = saved["optimizer"]["zenflow"]["window_steps"]
        # "factored"'s factors of the first matrix, as this rank holds them
        result["saved_factors"] = {k: tuple(local(t).shape) for k, t in
                                   saved["optimizer"]["state"][0]["host"].items()
                                   if k.endswith("_factors")}
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **kwargs) as opt:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed"] = full_weights(model)


def dcp_save(model, opt, path: str) -> None:
    """The model's and the optimizer's sharded state through torch.distributed.checkpoint, as
    torch's recipe does it (every rank writes its own blocks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    """The inverse of dcp_save on a fresh model and optimizer, on any number of ranks: the
    templates from get_state_dict say which blocks this rank holds; DCP reads them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _dcp_kwargs(options):
    return dict(optimizer_kwargs(True), weight_decay=0.01, worker=options.get("worker", True),
                **options.get("settings", {}))


def _dcp_resume(rank, world, steps, options, result):
    """Three runs of `steps` steps: straight; half, a DCP save, the other half in the same
    optimizer; a fresh model and optimizer that load the DCP checkpoint and train the second
    half. Also: getting the state dict of a fresh optimizer (DCP's template) runs no step."""
    path = options["dir"]
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        train_share(model, opt, 0, steps, rank, world)
        result["straight"] = full_weights(model)
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        train_share(model, opt, 0, steps // 2, rank, world)
        dcp_save(model, opt, path)
        result["selections_saved"] = selections(opt)
        train_share(model, opt, steps // 2, steps, rank, world)
        result["continued"] = full_weights(model)
    model = sharded_mlp()
    before = full_weights(model)
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        get_optimizer_state_dict(model, opt)
        result["fresh_untouched"] = (opt.counters.step == 0 and opt.counters.window_steps == 0
                                     and all(p.grad is None for p in model.parameters())
                                     and all(torch.equal(a, b) for a, b in
                                             zip(before.values(), full_weights(model).values())))
        dcp_load(model, opt, path)
        result["loaded_step"] = opt.counters.step
        result["selections_loaded"] = selections(opt)
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed"] = full_weights(model)
        result["selections"] = selections(opt)
    # Whole tensors in memory (full_state_dict=True, as some frameworks save), loaded by
    # set_state_dict, which loads the optimizer before the model: the same exact resume.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    whole = StateDictOptions(full_state_dict=True)
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        train_share(model, opt, 0, steps // 2, rank, world)
        model_sd, optim_sd = get_state_dict(model, opt, options=whole)
        result["whole_shape"] = tuple(optim_sd["state"]["0.weight"]["host"]["master"].shape)
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=whole)
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed_whole"] = full_weights(model)


def _dcp_factors(rank, world, steps, options, result):
    """The DCP checkpoint _dcp_resume saved at step steps // 2 (options["dir"]), loaded where the
    template asks for "factored"'s factors, which DCP reads only then (an optimizer places them
    at its first step: a fresh one's template holds none): by an optimizer that has taken a few
    steps of its own (options["stepped"]; each rank must get its own back), or by a fresh one
    whose template the engine's with_saved_factors completes from the checkpoint's metadata.
    Then the second half."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zenflow.engine.checkpoint_dcp import with_saved_factors
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        if options.get("stepped"):
            train_share(model, opt, 0, 3, rank, world)
        model_sd, optim_sd = get_state_dict(model, opt)
        if not options.get("stepped"):
            saved = dcp.FileSystemReader(options["dir"]).read_metadata().state_dict_metadata
            optim_sd = with_saved_factors(optim_sd, saved)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=options["dir"])
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        result["loaded_step"] = opt.counters.step
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed"] = full_weights(model)


def _dcp_reshard(rank, world, steps, options, result):
    """Load a DCP checkpoint saved on another number of ranks and train the second half."""
    model = sharded_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs(options)) as opt:
        if options.get("weights_only"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                set_model_state_dict,
            )
            model_sd = get_model_state_dict(model)
            dcp.load({"model": model_sd}, checkpoint_id=options["dir"])
            set_model_state_dict(model, model_sd)
            result["weights"] = full_weights(model)
            return
        dcp_load(model, opt, options["dir"])
        result["loaded_step"] = opt.counters.step
        result["host_rows"] = [m.local.shape[0] for m in opt._host_params]
        result["selections_loaded"] = selections(opt)
        train_share(model, opt, steps // 2, steps, rank, world)
        result["resumed"] = full_weights(model)
        result["selections"] = selections(opt)


def fsdp_engine_config(world: int, overlap: bool = True) -> dict:
    """The DDP tests' DeepSpeed JSON as stage 3 with its zenflow block: FSDP2 here."""
    from helpers.dist_ranks import engine_config
    config = engine_config(overlap, world)
    config["zero_optimization"]["stage"] = 3
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 1e6   # FSDP2's job: ignored
    return config


def _engine_steps(engine, start: int, stop: int, rank: int, world: int) -> None:
    for t in range(start, stop):
        x, y = my_share(t, rank, world)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _engine(rank, world, steps, options, result):
    """zenflow.initialize on an FSDP2 model with a stage-3 config: STEPS steps; with options
    "dir": half, save_checkpoint, half (the straight run), and a fresh engine that loads the
    checkpoint and trains the second half."""
    overlap = options.get("overlap", True)
    engine, opt, _, _ = zenflow.initialize(model=sharded_mlp(),
                                           config=fsdp_engine_config(world, overlap))
    result["optimizer"] = type(opt).__name__
    result["not_averaged"] = engine._fsdp2
    path = options.get("dir")
    _engine_steps(engine, 0, steps // 2 if path else steps, rank, world)
    if path:
        engine.save_checkpoint(path, tag="half")
        _engine_steps(engine, steps // 2, steps, rank, world)
    engine.synchronize()
    result["weights"] = full_weights(engine.module)
    result["selections"] = selections(opt)
    if options.get("export"):   # the whole weights, gathered, written by rank 0
        engine.save_16bit_model(options["export"], "model.bin")
        if rank == 0:
            result["exported"] = torch.load(os.path.join(options["export"], "model.bin"),
                                            weights_only=True)
    engine.close()
    if path:
        engine, opt, _, _ = zenflow.initialize(model=sharded_mlp(),
                                               config=fsdp_engine_config(world, overlap))
        loaded, _ = engine.load_checkpoint(path)
        result["loaded_steps"] = engine.global_steps
        _engine_steps(engine, steps // 2, steps, rank, world)
        engine.synchronize()
        result["resumed"] = full_weights(engine.module)
        engine.close()


def _engine_reshard(rank, world, steps, options, result):
    """Another number of ranks loads the 2-rank engine checkpoint: everything, and weights only."""
    engine, opt, _, _ = zenflow.initialize(model=sharded_mlp(),
                                           config=fsdp_engine_config(world))
    engine.load_checkpoint(options["dir"])
    result["loaded_steps"] = engine.global_steps
    _engine_steps(engine, steps // 2, steps, rank, world)
    engine.synchronize()
    result["resumed"] = full_weights(engine.module)
    result["selections"] = selections(opt)
    engine.close()
    engine, opt, _, _ = zenflow.initialize(model=sharded_mlp(),
                                           config=fsdp_engine_config(world))
    engine.load_checkpoint(options["dir"], load_module_only=True)
    result["module_only_steps"] = engine.global_steps
    result["module_only"] = full_weights(engine.module)
    engine.close()


def _engine_refused(rank, world, steps, options, result):
    """What does not map is refused by name before the model is touched."""
    from zenflow.config.loading import ConfigError
    errors = {}
    model = sharded_mlp()
    config = fsdp_engine_config(world)
    config["bf16"] = {"enabled": True}
    try:
        zenflow.initialize(model=model, config=config)
    except ConfigError as exc:
        errors["bf16"] = str(exc)
    result["untouched"] = all(p.dtype == torch.float32 for p in model.parameters())
    try:
        zenflow.initialize(model=make_mlp(), config=fsdp_engine_config(world))
    except ConfigError as exc:
        errors["stage3_unsharded"] = str(exc)
    result["errors"] = errors


MODES = {"fsdp": _fsdp, "engine": _engine, "engine_reshard": _engine_reshard,
         "engine_refused": _engine_refused, "refused": _refused, "resume": _resume, "dcp_resume": _dcp_resume,
         "dcp_reshard": _dcp_reshard, "dcp_factors": _dcp_factors}


def _runs(rank, world, steps, options, result):
    """Several runs in one set of processes (starting ranks is most of a test's time here):
    options["runs"] is {name: (mode, options)}; result[name] is that run's result."""
    for name, (mode, run_options) in options["runs"].items():
        result[name] = {}
        MODES[mode](rank, world, steps, run_options, result[name])


MODES["runs"] = _runs


def fsdp_rank_main(rank: int, world: int, port: int, mode: str, out_dir: str, steps: int,
                   options: dict):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        MODES[mode](rank, world, steps, options, result)
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


STEPS = 20


def run_fsdp(tmp_path, mode, world=2, steps=STEPS, timeout=120, **options):
    """fsdp_rank_main(mode) on `world` spawned ranks (the test's side): what each rank wrote."""
    return spawn_ranks(fsdp_rank_main, (mode, str(tmp_path), steps, options), tmp_path, world,
                       timeout)
