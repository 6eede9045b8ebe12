"""Atomic checkpoint directories with a manifest of file sizes and SHA-256 checksums.

A checkpoint is `<save_dir>/<tag>/` holding some files and `manifest.json`. It is written into a
hidden temporary directory next to it, every file is fsynced, the manifest is written last, and
only then is the directory renamed to its tag (a rename is atomic on one file system). The
`latest` file, which names the newest tag as in DeepSpeed, is replaced atomically afterwards.
So a crash at any point leaves either the previous checkpoint or the complete new one; and a
directory that was damaged later (truncated copy, missing file) fails verification on load.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "zenflow-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag or os.sep in tag \
            or tag == LATEST:
        raise ValueError(f"checkpoint tag must be a plain directory name (no '/', not starting "
                         f"with '.', not {LATEST!r}), got {tag!r}")
    return tag


def write_checkpoint(save_dir: str | os.PathLike, tag: str, objects: dict[str, Any],
                     meta: Optional[dict] = None, *, update_latest: bool = True,
                     _before_rename: Optional[Callable[[Path], None]] = None) -> Path:
    """Save each object with torch.save as `<name>` inside `<save_dir>/<tag>/`, atomically."""
    tag = check_tag(tag)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / tag
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir))
    try:
        files = {}
        for name, obj in objects.items():
            path = tmp / name
            buf = io.BytesIO()
            torch.save(obj, buf)
            with open(path, "wb") as f:
                f.write(buf.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            files[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"format": FORMAT, "tag": tag, "files": files, "meta": meta or {}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if _before_rename is not None:  # test hook: simulate a crash before the commit point
            _before_rename(tmp)
        old = None
        if final.exists():
            old = save_dir / f".{tag}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(save_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if update_latest:
        latest_tmp = save_dir / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
        latest_tmp.write_text(tag)
        with open(latest_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(latest_tmp, save_dir / LATEST)
        _fsync_dir(save_dir)
    return final


def resolve_tag(load_dir: str | os.PathLike, tag: Optional[str]) -> str:
    load_dir = Path(load_dir)
    if tag is not None:
        return check_tag(tag)
    latest = load_dir / LATEST
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint to load: {str(latest)!r} does not exist "
                              f"(pass tag= to load a specific checkpoint)")
    return check_tag(latest.read_text().strip())


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check the manifest against the files on disk; return the manifest or raise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} "
                              f"(the save was interrupted or the directory was not written by "
                              f"zenflow); refusing to load it")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {MANIFEST}: {exc}")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or damaged: {name} has "
                                  f"{size} bytes, the manifest says {expected['size']}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: the SHA-256 of {name} "
                                  f"does not match the manifest")
    return manifest


def read_checkpoint(load_dir: str | os.PathLike, tag: Optional[str], names: list[str],
                    map_location=None) -> tuple[Path, dict, dict[str, Any]]:
    """Verify `<load_dir>/<tag>` (tag from `latest` when None) and torch.load the named files.

    The files are unpickled (they hold RNG states and optimizer internals), so, as with
    torch.load, only load checkpoints you trust; the checksums catch damage, not tampering.
    """
    path = Path(load_dir) / resolve_tag(load_dir, tag)
    manifest = verify_checkpoint(path)
    missing = [n for n in names if n not in manifest["files"]]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}")
    objects = {n: torch.load(path / n, map_location=map_location, weights_only=False)
               for n in names}
    return path, manifest, objects
