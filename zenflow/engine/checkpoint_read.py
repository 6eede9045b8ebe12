"""Reading a checkpoint directory that zenflow/engine/checkpoint.py wrote: the tag `latest`
names, the manifest's structure, every file's size and SHA-256, then each file with
torch.load(weights_only=True). A damaged, incomplete or planted checkpoint is a CheckpointError
before a single object of it is built; an overwrite that a crash interrupted is finished first.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from zenflow.engine.checkpoint import (
    FORMAT,
    LATEST,
    MANIFEST,
    check_entry_name,
    check_tag,
    file_sha256,
    recover_tag,
)
from zenflow.engine.checkpoint_lock import CheckpointError, TagLock

_SHA256 = re.compile(r"[0-9a-f]{64}")


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> str:
    load_dir = Path(load_dir)
    if tag is not None:
        return check_tag(tag)
    latest = load_dir / LATEST
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint to load: {str(latest)!r} does not exist "
                              f"(pass tag= to load a specific checkpoint)")
    try:
        return check_tag(latest.read_bytes().decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{str(latest)!r} must hold the name of a checkpoint directory, "
                              f"got {latest.read_bytes()[:80]!r}") from None


def _bad_manifest(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(path)!r} has an unreadable {MANIFEST}: {problem}; "
                           f"refusing to load it")


def _manifest(path: Path) -> dict:
    """Read and check the structure of `<path>/manifest.json`."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
        raise _bad_manifest(path, f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") \
            from None
    if not isinstance(manifest, dict):
        raise _bad_manifest(path, f"it must hold a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise _bad_manifest(path, f"format must be {FORMAT!r}, got {manifest.get('format')!r}")
    files, meta = manifest.get("files"), manifest.get("meta", {})
    if not isinstance(files, dict):
        raise _bad_manifest(path, f"files must be an object mapping file names to their size and "
                                  f"sha256, got {type(files).__name__}")
    if not isinstance(meta, dict):
        raise _bad_manifest(path, f"meta must be an object, got {type(meta).__name__}")
    for name, entry in files.items():
        try:
            check_entry_name(name)
        except ValueError as exc:
            raise _bad_manifest(path, str(exc)) from None
        if not isinstance(entry, dict):
            raise _bad_manifest(path, f"files[{name!r}] must be an object with size and sha256, "
                                      f"got {entry!r:.80}")
        size, digest = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise _bad_manifest(path, f"files[{name!r}].size must be a byte count (an integer "
                                      f">= 0), got {size!r:.80}")
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise _bad_manifest(path, f"files[{name!r}].sha256 must be 64 hex digits, got "
                                      f"{digest!r:.80}")
    return dict(manifest, meta=meta)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check the manifest against the files on disk; return the manifest or raise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} "
                              f"(the save was interrupted or the directory was not written by "
                              f"zenflow); refusing to load it")
    manifest = _manifest(path)
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or damaged: {name} has "
                                  f"{size} bytes, the manifest says {expected['size']}")
        if file_sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: the SHA-256 of {name} "
                                  f"does not match the manifest")
    return manifest


def load_object(path: str | os.PathLike, map_location=None) -> Any:
    """torch.load with weights_only=True: tensors and plain data only, never code.

    Anything else (a pickled callable, a foreign class) is refused with a CheckpointError
    before a single object of the file is built.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"unsupported (GLOBAL [^ ]+|[^\n]*)", str(exc), re.IGNORECASE)
        what = found.group(0) if found else str(exc).splitlines()[0]
        raise CheckpointError(f"{str(path)!r} holds something other than tensors and plain data "
                              f"({what}); zenflow loads checkpoints with weights_only=True and "
                              f"never runs code from them; refusing to load it") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a readable torch.save file: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from None


def read_checkpoint(load_dir: str | os.PathLike, tag: str | None, names: list[str],
                    map_location=None) -> tuple[Path, dict, dict[str, Any]]:
    """Verify `<load_dir>/<tag>` (tag from `latest` when None) and load the named files.

    Every file is read with weights_only=True (see load_object); the checksums catch damage,
    the weights-only loader refuses anything that could run code.
    """
    load_dir = Path(load_dir)
    tag = resolve_tag(load_dir, tag)
    path = load_dir / tag
    if not os.path.lexists(path) and load_dir.is_dir():
        with TagLock(load_dir, tag, optional=True) as lock:
            if lock.fd is not None:
                recover_tag(load_dir, tag)  # finish an overwrite that a crash interrupted
    # A shared lock: a save of this tag cannot swap the directory mid-read; other readers can.
    with TagLock(load_dir, tag, optional=True, shared=True):
        manifest = verify_checkpoint(path)
        missing = [n for n in names if n not in manifest["files"]]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}")
        objects = {n: load_object(path / n, map_location=map_location) for n in names}
    return path, manifest, objects
