"""Data-parallel checkpoints in which each rank writes only its own share.

Each rank's optimizer holds only its rows of the host state, so each rank writes its own file
(`rank<r>_states.pt`) into a staging directory next to the checkpoint, in parallel; only small
metadata (a name, a size, a checksum) crosses the network. Rank 0 then writes the files every
rank has in common (the model, the engine state) and commits the whole directory atomically with
`write_checkpoint`, moving the other ranks' files in unread. No rank ever holds another rank's
host state, in memory or in a collective. The save directory must be shared by the ranks, as it
must be for loading.
"""
from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zenflow.distributed import Partition
from zenflow.engine.checkpoint import (
    CheckpointError,
    check_tag,
    file_entry,
    save_file,
    write_checkpoint,
)


def write_sharded_checkpoint(partition: Partition, save_dir, tag: str, common: dict[str, Any],
                             share_name: str, share: Any, meta: dict | None = None, *,
                             update_latest: bool = True,
                             collective: Callable[[Path], None] | None = None) -> Path:
    """Every rank calls it with its own `share`; rank 0's `common` objects are written once.
    `collective(folder)`, called by every rank after its share is written, may write more files
    into one fresh subdirectory of `folder` (torch.distributed.checkpoint's save, a collective
    of its own); they join the checkpoint under that subdirectory."""
    tag = check_tag(tag)
    save_dir = Path(save_dir)
    ident = partition.broadcast_object(uuid.uuid4().hex if partition.rank == 0 else None,
                                       "naming the checkpoint's staging directory")
    staging = save_dir / f".{tag}.shares-{ident}"
    try:
        staging.mkdir(parents=True, exist_ok=True)
        mine: Any = (share_name, save_file(staging / share_name, share))
    except Exception as exc:  # every rank must reach the collectives below
        mine = f"rank {partition.rank}: {type(exc).__name__}: {exc}"
    entries = partition.gather_objects(mine, "collecting the checkpoint shares' checksums")
    failed = [e for e in entries if isinstance(e, str)]
    if collective is not None and not failed:   # every rank runs it, or none
        problem = None
        try:
            collective(staging)
        except Exception as exc:
            problem = f"rank {partition.rank}: {type(exc).__name__}: {exc}"
        failed += [p for p in partition.gather_objects(problem, "collecting the save's outcome")
                   if p]
    status = None
    if partition.rank == 0:
        try:
            if not failed:
                prewritten = {name: (staging / name, entry) for name, entry in entries}
                for folder in (d for d in staging.iterdir() if d.is_dir()):
                    prewritten.update({f"{folder.name}/{f.name}": (f, file_entry(f))
                                       for f in folder.iterdir()})
                write_checkpoint(save_dir, tag, common, meta, update_latest=update_latest,
                                 prewritten=prewritten)
        except Exception as exc:
            status = f"rank 0: {type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    status = partition.broadcast_object(status, "committing the checkpoint")
    problems = failed + ([status] if status else [])
    if problems:
        raise CheckpointError(f"saving checkpoint {str(save_dir / tag)!r} failed: "
                              + "; ".join(problems))
    return save_dir / tag
