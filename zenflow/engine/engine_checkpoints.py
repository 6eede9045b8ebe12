"""The engine's checkpoints: `save_checkpoint` and `load_checkpoint`, as a mixin of
`zenflow.engine.engine.ZenFlowEngine` (which provides config, module, optimizer, the counters and
the weight sync).

What each file of a checkpoint holds: model_states.pt the synchronized weights; engine_states.pt
the counters, schedule, loss scale, fp32 masters, RNG, config, client state and the weights
training runs on until the in-flight update lands; optimizer_states.pt (one process) or
rank<N>_states.pt (data parallel: each rank's share of the host state, and its RNG). The
directory itself is written atomically by zenflow/engine/checkpoint.py and read back by
checkpoint_read.py; an FSDP2 model's goes through torch.distributed.checkpoint
(checkpoint_dcp.py).
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zenflow.compat.deepspeed import comm
from zenflow.engine.checkpoint import check_tag, write_checkpoint
from zenflow.engine.checkpoint_dcp import load_fsdp2_checkpoint, save_fsdp2_checkpoint
from zenflow.engine.checkpoint_read import load_object, read_checkpoint
from zenflow.engine.checkpoint_shards import write_sharded_checkpoint
from zenflow.engine.deepspeed_api import frozen_parameter_names
from zenflow.engine.weight_sync import synchronized_state

log = logging.getLogger("zenflow.engine")


class EngineCheckpoints:
    """save_checkpoint and load_checkpoint, with the checks that ranks agree on them."""

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write `<save_dir>/<tag>/` atomically; every rank must call it.

        The tag defaults to `global_step<N>`; any other is used as str(tag), as in DeepSpeed
        (whose tutorial passes a loss value). model_states.pt holds the synchronized weights
        (ZenFlow's in-flight update installed), and the run that saves continues exactly as if
        it had not. Returns the checkpoint's path (truthy, where DeepSpeed returns True).
        """
        self._require_every_rank("save_checkpoint")
        tag = self._common_tag(str(tag) if tag is not None else f"global_step{self.global_steps}")
        if self._micro_steps_into_accumulation():
            log.warning("saving a checkpoint in the middle of gradient accumulation: the "
                        "gradients accumulated so far are not saved")
        module_state = pending = optimizer_state = {}
        if not self._fsdp2:   # FSDP2: in checkpoint_dcp.py, through torch.distributed.checkpoint
            module_state, pending, optimizer_state = synchronized_state(
                self.module, self.optimizer, self._weight_sync)
        excluded = sorted(frozen_parameter_names(self.module)) if exclude_frozen_parameters else []
        engine_state = {
            "global_steps": self.global_steps, "micro_steps": self.micro_steps,
            "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "fp32_masters": self._masters.state_dict() if self._masters else None,
            "rng": _rng_state(), "client_state": client_state or {},
            "config": self._raw_config,
            "optimizer_class": type(self.optimizer).__name__,
            # The weights training runs on until the in-flight update lands: restored with the
            # optimizer state for an exact resume. Frozen parameters left out, if asked.
            "pending_weights": pending, "excluded_frozen": excluded,
        }
        partition = self._ranks()
        meta = {"global_steps": self.global_steps, "world_size": partition.world_size,
                "optimizer_class": type(self.optimizer).__name__, "dtype": str(self.dtype)}
        if self._fsdp2:
            return str(save_fsdp2_checkpoint(self, save_dir, tag, engine_state, meta,
                                             save_latest, excluded))
        module_state = {k: v for k, v in module_state.items() if k not in set(excluded)}
        objects = {"model_states.pt": module_state, "engine_states.pt": engine_state}
        if not partition.active:
            objects["optimizer_states.pt"] = optimizer_state
            return str(write_checkpoint(save_dir, tag, objects, meta, update_latest=save_latest))
        # Data parallel: each rank writes its own share of the host state and its RNG; rank 0
        # commits them with the common files (zenflow/engine/checkpoint_shards.py).
        return str(write_sharded_checkpoint(
            partition, save_dir, tag, objects, f"rank{partition.rank}_states.pt",
            {"optimizer": optimizer_state, "rng": engine_state["rng"]}, meta,
            update_latest=save_latest))

    def _require_every_rank(self, method: str) -> None:
        """Under data parallel, raise before a collective that not every rank calls (it would
        hang): the ranks meet in the store first (rank_agreement.py)."""
        if self._agreement is None:
            return
        missing, why = self._agreement.missing_from(method, comm.DEFAULT_TIMEOUT)
        if missing:
            how = {"left": "went on training without calling it",
                   "exited": "ended without calling it (the process exited)",
                   "waiting": "wait in another collective call (a barrier, or another save)",
                   "late": f"did not call it within {comm.DEFAULT_TIMEOUT.total_seconds():g} s",
                   }[why]
            raise RuntimeError(
                f"{method} is collective: every rank must call it (each rank writes its share of "
                f"the optimizer state, and installing the in-flight update is collective), but "
                f"rank(s) {', '.join(map(str, missing))} {how}. Call {method} on every rank, "
                f"not only on rank 0 (rank 0 alone writes the common files)")

    def _common_tag(self, tag: str) -> str:
        """Rank 0's tag, as DeepSpeed uses: ranks whose tags differ (a tag made from each rank's
        own loss, say) are warned about, ignored or refused as checkpoint.tag_validation says."""
        partition = self._ranks()
        if not partition.active:
            return check_tag(tag)
        tags = partition.gather_objects(tag, "comparing the checkpoint tags")
        if len(set(tags)) > 1:
            mode = self.config.checkpoint.tag_validation
            message = (f"save_checkpoint: the ranks passed different tags ({', '.join(tags[:4])}"
                       f"{', ...' if len(tags) > 4 else ''}); ")
            if mode == "FAIL":
                raise ValueError(message + "checkpoint.tag_validation is \"Fail\"; pass the same "
                                 "tag on every rank")
            if mode == "WARN":
                log.warning(message + "saving under rank 0's tag %r (checkpoint.tag_validation "
                            "\"Warn\"; \"Ignore\" silences this)", tags[0])
        return check_tag(tags[0])

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict | None]:
        """Verify and restore a checkpoint (DeepSpeed's arguments, in its order). Returns
        (path, client_state); (None, None) with a warning when `load_dir` has no `latest`
        checkpoint and no tag is given, as DeepSpeed does. A named tag that is missing raises.
        `custom_load_fn(src=state_dict, dst=module)` replaces module.load_state_dict."""
        if tag is None and not (Path(load_dir) / "latest").is_file():
            log.warning("load_checkpoint: %r has no 'latest' file, so there is no checkpoint to "
                        "load; nothing was loaded (pass tag= to load a specific one)",
                        str(load_dir))
            return None, None
        tag = None if tag is None else str(tag)
        if self._fsdp2:
            return self._load_fsdp2_checkpoint(load_dir, tag, load_module_strict,
                                               load_optimizer_states, load_lr_scheduler_states,
                                               load_module_only)
        partition = self._ranks()
        mine = f"rank{partition.rank}_states.pt" if partition.active else "optimizer_states.pt"
        path, manifest, objs = read_checkpoint(
            load_dir, tag, ["model_states.pt", "engine_states.pt"], map_location="cpu")
        saved_world = manifest["meta"].get("world_size", 1)
        if not load_module_only and saved_world != partition.world_size:
            raise ValueError(f"checkpoint {str(path)!r} was written by {saved_world} rank(s) and "
                             f"this run has {partition.world_size}: each rank's optimizer holds "
                             "only its share of the host state, so resume on the same number of "
                             "ranks (or pass load_module_only=True to load only the weights)")
        if mine not in manifest["files"] and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} has no {mine}")
        state = objs["engine_states.pt"]
        # With load_module_only no optimizer share is read: the weights are whole in every
        # checkpoint, so any world size loads them.
        if not load_module_only and partition.active:
            # read_checkpoint verified this rank's file with the others
            share = load_object(path / mine, map_location="cpu")
            objs["optimizer_states.pt"] = share["optimizer"]
            state = dict(state, rng=share["rng"])
        elif not load_module_only:
            objs["optimizer_states.pt"] = load_object(path / mine, map_location="cpu")
        if state["optimizer_class"] != type(self.optimizer).__name__ and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} was written with "
                             f"{state['optimizer_class']}, this engine runs "
                             f"{type(self.optimizer).__name__}; pass load_module_only=True to "
                             f"load only the weights")
        # All or nothing: everything is checked against the model and optimizer first.
        if custom_load_fn is None:
            self._check_module_state(objs["model_states.pt"], state, load_module_strict)
        check_optimizer = getattr(self.optimizer, "check_state_dict", None)
        if not load_module_only and load_optimizer_states and check_optimizer is not None:
            check_optimizer(objs["optimizer_states.pt"])
        self._load_module_state(objs["model_states.pt"], state, load_module_strict, custom_load_fn,
                                with_pending=not load_module_only and load_optimizer_states)
        self._weight_sync.loaded()
        if not load_module_only:
            if load_optimizer_states:
                self.optimizer.load_state_dict(objs["optimizer_states.pt"])
                if self._masters is not None and state["fp32_masters"] is not None:
                    self._masters.load_state_dict(state["fp32_masters"])
            self._load_engine_state(state, load_lr_scheduler_states)
        return str(path), state["client_state"]

    def _load_engine_state(self, state: dict, load_lr_scheduler_states: bool) -> None:
        if load_lr_scheduler_states and self.lr_scheduler is not None \
                and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for key in ("global_steps", "micro_steps", "global_samples", "skipped_steps"):
            setattr(self, key, state[key])
        if state.get("rng") is not None:
            _set_rng_state(state["rng"])

    def _load_fsdp2_checkpoint(self, load_dir, tag: str | None, strict: bool,
                               load_optimizer_states: bool, load_lr_scheduler_states: bool,
                               load_module_only: bool) -> tuple[str, dict]:
        """An FSDP2 engine's checkpoint (checkpoint_dcp.py), on any number of ranks: DCP reads
        each rank's rows; a rank the saving run did not have keeps its RNG as it is."""
        partition = self._ranks()
        path, manifest, objs = read_checkpoint(load_dir, tag, ["engine_states.pt"],
                                               map_location="cpu")
        if not manifest["meta"].get("fsdp2"):
            raise ValueError(f"checkpoint {str(path)!r} was not written by an FSDP2-sharded "
                             "engine (it holds whole weights, not torch.distributed.checkpoint "
                             "shards); load it into an engine whose model is not sharded")
        state = objs["engine_states.pt"]
        if state["optimizer_class"] != type(self.optimizer).__name__ and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} was written with "
                             f"{state['optimizer_class']}, this engine runs "
                             f"{type(self.optimizer).__name__}; pass load_module_only=True to "
                             f"load only the weights")
        load_optimizer = load_optimizer_states and not load_module_only
        load_fsdp2_checkpoint(self, path, load_optimizer=load_optimizer, strict=strict)
        self._weight_sync.loaded()
        if not load_module_only:
            share = f"rank{partition.rank}_states.pt"
            rng = (load_object(path / share, map_location="cpu")["rng"]
                   if share in manifest["files"] else None)
            if rng is None:
                log.info("load_checkpoint: the checkpoint has no RNG state for rank %d (it was "
                         "saved on %s rank(s)); this rank's RNG is left as it is",
                         partition.rank, manifest["meta"].get("world_size"))
            self._load_engine_state(dict(state, rng=rng), load_lr_scheduler_states)
        return str(path), state["client_state"]


def _rng_state() -> dict:
    """Every RNG's state as tensors and plain data, so that a weights-only load reads it."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached_gaussian": cached},
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))
