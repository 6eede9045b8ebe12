"""The engine's checkpoints of an FSDP2-sharded model, through torch.distributed.checkpoint.

The checkpoint directory is the engine's usual one (atomic, with a manifest of checksums;
checkpoint.py and checkpoint_shards.py): `engine_states.pt` (counters, schedules, config) and
one `rank<r>_states.pt` per rank (its RNG) as under DDP, plus `distributed_checkpoint/`, which
every rank writes with `dcp.save`:

    "model":   the synchronized weights (ZenFlow's in-flight update installed), as DTensors
    "pending": the weights training runs on until that update lands (only those it changes)
    "optim":   get_optimizer_state_dict(): ZenFlow's state with each rank's rows as DTensors

Each rank writes only its own rows. Because every tensor says where its rows belong in the
whole tensor, the checkpoint loads on any number of ranks (DCP reads whatever rows the loading
ranks hold): the weights always, the optimizer state when the optimizer's state reshards
(ZenFlowAdamW's and OffloadAdamW's do; zenflow/optim/state.py). The run that saves continues as
if it had not; a run resumed on as many ranks continues exactly as the saving run does.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zenflow.distributed import Partition, is_sharded, local, sharded_like
from zenflow.engine.checkpoint_shards import write_sharded_checkpoint

DCP_DIR = "distributed_checkpoint"
_PENDING = "pending."


def _dcp():
    """torch.distributed.checkpoint and its state-dict helpers (imported when first used)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as helpers
    return dcp, helpers


def _changed_keys(live: dict, training: dict, partition: Partition) -> list[str]:
    """The weights the install changed on any rank (each rank compares its own rows; every rank
    must save the same keys)."""
    mine = [k for k, t in training.items() if not torch.equal(local(live[k]).detach(), t)]
    return sorted(set().union(*partition.gather_objects(mine, "collecting the changed weights")))


def save_fsdp2_checkpoint(engine, save_dir, tag: str, engine_state: dict, meta: dict,
                          update_latest: bool, excluded: list[str]) -> Path:
    """Every rank calls it (after the engine agreed on the tag)."""
    dcp, helpers = _dcp()
    partition = Partition.from_group(None, engine.device)
    module, optimizer, sync = engine.module, engine.optimizer, engine._weight_sync

    def save(staging: Path) -> None:
        with sync.paused():   # this function's own reads must not synchronize
            optim_state = helpers.get_optimizer_state_dict(module, optimizer)
            live = helpers.get_model_state_dict(module)
            training = {}
            if sync.defers_updates:   # install the update in flight to save current weights
                training = {k: local(v).detach().clone() for k, v in live.items()
                            if is_sharded(v)}
                optimizer.synchronize()
            changed = _changed_keys(live, training, partition) if training else []
            pending = {k: sharded_like(training[k], live[k]) for k in changed}
            weights = {k: v for k, v in live.items() if k not in set(excluded)}
            dcp.save({"model": weights, "pending": pending, "optim": optim_state},
                     checkpoint_id=str(staging / DCP_DIR))
            if changed:   # back to the weights training runs on, and the update in flight
                with torch.no_grad():
                    for k in changed:
                        local(live[k]).copy_(training[k])
                optimizer.load_state_dict(optim_state)

    return write_sharded_checkpoint(
        partition, save_dir, tag, {"engine_states.pt": engine_state},
        f"rank{partition.rank}_states.pt", {"rng": engine_state["rng"]},
        {**meta, "fsdp2": True}, update_latest=update_latest, collective=save)


def with_saved_factors(optim_state: dict, saved: dict, prefix: str = "optim") -> dict:
    """`optim_state` (a template from get_optimizer_state_dict) with a template of each
    "factored" matrix's factors that the checkpoint holds (`saved`: its metadata's
    state_dict_metadata, the optimizer's state under `prefix`) and the template lacks. DCP reads
    only what a template holds, and an optimizer places its factors at its first step, so a
    fresh one's holds none. Only the factors this rank saved on as many ranks fit its shard
    (zenflow/optim/state.py); others are left out, and those matrices load as from another
    rule."""
    for fqn, piece in optim_state.get("state", {}).items():
        host = piece.get("host") if isinstance(piece, dict) else None
        if not isinstance(host, dict) or "row_factors" in host or not is_sharded(host["master"]):
            continue
        rows_key, cols_key = (f"{prefix}.state.{fqn}.host.{k}" for k in ("row_factors", "col_factors"))
        master = host["master"]   # [rows, cols], sharded as the parameter's rows
        ranks, rank, cols = master.device_mesh.size(), master.device_mesh.get_local_rank(), master.shape[1]
        blocks = saved.get(cols_key)
        if rows_key in saved and tuple(getattr(blocks, "size", ())) == (3 * ranks, cols) and any(
                list(chunk.offsets) == [3 * rank, 0] for chunk in blocks.chunks):
            rows = local(master).shape[0]
            host["row_factors"] = sharded_like(torch.zeros(3, rows), master, 1)
            host["col_factors"] = sharded_like(torch.zeros(3, cols), master, 0, 3 * ranks)
    return optim_state


def load_fsdp2_checkpoint(engine, path: Path, *, load_optimizer: bool, strict: bool) -> None:
    """Load `path/distributed_checkpoint` into the engine's module (the training weights when the
    optimizer state is loaded too, else the synchronized ones) and optimizer. The reads go into
    copies first, so that a checkpoint that does not fit changes nothing."""
    dcp, helpers = _dcp()
    module, optimizer = engine.module, engine.optimizer
    folder = str(path / DCP_DIR)
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    with engine._weight_sync.paused():
        weights = {k: v.detach().clone() for k, v in helpers.get_model_state_dict(module).items()}
        state = {"model": weights}
        if load_optimizer:
            pending = {k[len(_PENDING):] for k in saved if k.startswith(_PENDING)}
            state["pending"] = {k: weights[k].clone() for k in weights if k in pending}
            state["optim"] = with_saved_factors(
                helpers.get_optimizer_state_dict(module, optimizer), saved)
        dcp.load(state, checkpoint_id=folder)
        check = getattr(optimizer, "check_state_dict", None)
        if load_optimizer and check is not None:
            check(state["optim"])
        options = helpers.StateDictOptions(strict=strict)
        helpers.set_model_state_dict(module, {**weights, **state.get("pending", {})},
                                     options=options)
        if load_optimizer:
            helpers.set_optimizer_state_dict(module, optimizer, state["optim"], options=options)
