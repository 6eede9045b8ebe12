"""Atomic checkpoint directories with a manifest of file sizes and SHA-256 checksums.

A checkpoint is `<save_dir>/<tag>/` holding some files and `manifest.json`. It is written into a
hidden staging directory next to it, every file is fsynced, the manifest is written last, and
only then does it take the tag's name (a rename is atomic on one file system); a tag being
overwritten is first renamed away and deleted only after the new one holds its name. The
`latest` file, which names the newest tag as in DeepSpeed, is replaced atomically afterwards.
Saves of one tag hold a lock (`checkpoint_lock.TagLock`), so concurrent savers take turns. A
crash at any point leaves either the previous checkpoint or the complete new one (an
interrupted overwrite is finished or undone by the next save or load of that tag), and a
directory that was damaged later (truncated copy, missing file) fails verification on load
(zenflow/engine/checkpoint_read.py reads checkpoints back).

Every file is read with torch.load(weights_only=True) and written only if such a load accepts
it: a checkpoint holds tensors and plain data, and loading one never runs code.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from zenflow.engine.checkpoint_lock import CheckpointError, TagLock

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "zenflow-checkpoint/1"
_STAGED = re.compile(r"^\.(?P<tag>.+)\.(?P<kind>tmp|new|old|shares)-[0-9a-f]{32}$")
# The staging names add 41 bytes to a tag (".<tag>.shares-<32 hex>"); a name has at most 255.
MAX_TAG_BYTES = 255 - 41


def file_sha256(path: Path) -> str:
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


def _check_file_name(name) -> str:
    if not isinstance(name, str) or not name or name in (".", "..", MANIFEST) \
            or "/" in name or os.sep in name or name.startswith("."):
        raise ValueError(f"a checkpoint file name must be a plain file name (no '/', not "
                         f"starting with '.', not {MANIFEST!r}), got {name!r}")
    return name


def check_entry_name(name) -> str:
    """A checkpoint file's name in the manifest: a plain file name, or a plain file name inside
    one plain subdirectory (torch.distributed.checkpoint's files, whose index is '.metadata')."""
    if isinstance(name, str) and name.count("/") == 1:
        folder, file = name.split("/")
        _check_file_name(folder)
        if file in ("", ".", "..", MANIFEST) or "\\" in file:
            raise ValueError(f"a checkpoint file name inside {folder!r} must be a plain file "
                             f"name, got {file!r}")
        return name
    return _check_file_name(name)


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag or os.sep in tag \
            or tag == LATEST:
        raise ValueError(f"checkpoint tag must be a plain directory name (no '/', not starting "
                         f"with '.', not {LATEST!r}), got {tag!r}")
    if tag != tag.strip() or any(not c.isprintable() for c in tag):
        # `latest` is read back stripped, so such a tag could never be loaded through it.
        raise ValueError(f"checkpoint tag {tag!r} has surrounding whitespace or a control "
                         "character (a newline, a tab); use a plain name")
    if len(tag.encode("utf-8", "surrogateescape")) > MAX_TAG_BYTES:
        raise ValueError(f"checkpoint tag {tag[:40]!r}... is {len(tag.encode('utf-8', 'surrogateescape'))} "
                         f"bytes long; at most {MAX_TAG_BYTES} fit in a directory name beside the "
                         "staging names' 41 bytes")
    return tag


def _fault_point(stage: str) -> None:
    """Test seam: tests replace this to crash or interrupt a save at each stage."""


def _leftovers(save_dir: Path, tag: str) -> dict[str, list[Path]]:
    """This tag's staging directories by kind: 'tmp' (partial), 'new' (complete, not yet
    committed) and 'old' (the replaced version, being deleted); newest first."""
    out: dict[str, list[Path]] = {"tmp": [], "new": [], "old": [], "shares": []}
    for entry in save_dir.iterdir():
        m = _STAGED.match(entry.name)
        if m and m.group("tag") == tag:
            out[m.group("kind")].append(entry)
    for paths in out.values():
        paths.sort(key=lambda q: q.stat().st_mtime_ns if q.exists() else 0, reverse=True)
    return out


def recover_tag(save_dir: Path, tag: str, keep: Path | None = None) -> None:
    """Finish or undo an interrupted save of `tag` (the caller holds the tag's lock).

    If the tag directory is missing, the newest complete new version takes its name (roll
    forward), else the retired old one gets it back (roll back). Then every staging directory
    of the tag is deleted (the shares of a data-parallel save that failed too), except `keep`
    (the shares of the save in progress).
    """
    final = save_dir / tag
    found = _leftovers(save_dir, tag)
    if not os.path.lexists(final):
        for candidate in found["new"] + found["old"]:
            if (candidate / MANIFEST).is_file():
                os.rename(candidate, final)
                _fsync_dir(save_dir)
                break
    for paths in found.values():
        for path in paths:
            if os.path.lexists(path) and path != keep:
                _remove(path, ignore_errors=True)


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete a retired or staged tag: a folder, or a symbolic link a user made the tag (the
    link goes, never what it points at: another checkpoint, often)."""
    if path.is_symlink():
        try:
            path.unlink()
        except OSError:
            if not ignore_errors:
                raise
        return
    shutil.rmtree(path, ignore_errors=ignore_errors)


class _RecordingWriter:
    """The file torch.save writes through, keeping the first exception its write() raised.

    torch's C++ writer turns an exception in write() (a Ctrl-C's KeyboardInterrupt, a full
    disk's OSError) into "RuntimeError: [enforce fail at inline_container.cc] unexpected pos";
    kept here, the original is raised instead."""

    def __init__(self, file):
        self._file = file
        self.error: BaseException | None = None

    def write(self, data) -> int:
        try:
            _fault_point("writing")
            return self._file.write(data)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def _write_error(path: Path, exc: BaseException) -> BaseException:
    """What a failed write of `path` raises: a KeyboardInterrupt as itself, a full disk as an
    OSError naming ENOSPC and the file, anything else unchanged."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        name = errno.errorcode[exc.errno]
        return OSError(exc.errno, f"{name}: no space left on the device (or the quota) while "
                                  f"writing the checkpoint file; the previous checkpoint is "
                                  f"intact. Free space and save again", str(path))
    return exc


def _save_object(path: Path, obj: Any) -> None:
    """torch.save straight to the file (no second copy in memory), fsynced; refuses anything a
    weights-only load would refuse (found by reading back only the file's pickle)."""
    writer = None
    try:
        with open(path, "wb") as f:   # closing flushes: a full disk may surface there too
            writer = _RecordingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        raise _write_error(path, (writer and writer.error) or exc) from None
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    if unsafe:
        name = path.name
        raise CheckpointError(
            f"cannot save {name}: it holds {', '.join(sorted(set(unsafe)))}, which a "
            f"weights-only load refuses; checkpoints hold only tensors and plain Python data "
            f"(numbers, strings, lists, tuples, dicts), e.g. client_state={{'epoch': 3}}")


def _write_file(path: Path, data) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp-{uuid.uuid4().hex}"
    try:
        _write_file(tmp, tag.encode())
        os.replace(tmp, save_dir / LATEST)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(save_dir)


def file_entry(path: Path) -> dict:
    """The manifest entry of a file written by other means (torch.distributed.checkpoint)."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def save_file(path: Path, obj: Any) -> dict:
    """Write one checkpoint file outside write_checkpoint (another rank's share, say); returns
    its manifest entry, for write_checkpoint's `prewritten`."""
    _check_file_name(path.name)
    _save_object(path, obj)
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def write_checkpoint(save_dir: str | os.PathLike, tag: str, objects: dict[str, Any],
                     meta: dict | None = None, *, update_latest: bool = True,
                     prewritten: dict[str, tuple[Path, dict]] | None = None) -> Path:
    """Save each object with torch.save as `<name>` inside `<save_dir>/<tag>/`, atomically.

    Holding the tag's lock: the files go into `.<tag>.tmp-*` (each checked to be weights-only
    loadable; if one is not, nothing else changes), which is renamed
    `.<tag>.new-*` once complete; an existing `<tag>` is renamed `.<tag>.old-*`, the new one
    takes its name, `latest` is replaced, and the old one is deleted. An interruption at any
    point is undone or finished at once (or, after a crash, by the next save or load), so
    `<tag>`, and the tag that `latest` names, is always a complete checkpoint.

    `prewritten` maps more file names to (a file on the same file system, its save_file entry):
    they are moved in unread (data parallel: each rank wrote its own share).
    """
    tag = check_tag(tag)
    prewritten = prewritten or {}
    for name in objects:
        _check_file_name(name)
    for name in prewritten:
        check_entry_name(name)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / tag
    # the folders the other ranks wrote into (a file in a subdirectory: its parent's parent)
    shares = {Path(src).parents[name.count("/")] for name, (src, _) in prewritten.items()}
    with TagLock(save_dir, tag):
        recover_tag(save_dir, tag, keep=next(iter(shares)) if len(shares) == 1 else None)
        ident = uuid.uuid4().hex
        tmp = save_dir / f".{tag}.tmp-{ident}"
        try:
            os.mkdir(tmp)
            files = {}
            for name, obj in objects.items():
                _save_object(tmp / name, obj)
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
            for name, (src, entry) in prewritten.items():
                if not Path(src).is_file() or Path(src).stat().st_size != entry["size"]:
                    raise CheckpointError(f"{str(src)!r}, written by another rank, is missing or "
                                          "incomplete here: ranks must share the save directory")
                (tmp / name).parent.mkdir(exist_ok=True)
                os.rename(src, tmp / name)
                files[name] = dict(entry)
            for folder in {(tmp / name).parent for name in prewritten} - {tmp}:
                _fsync_dir(folder)
            manifest = {"format": FORMAT, "tag": tag, "files": files, "meta": meta or {}}
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            _fault_point("written")
            staged = save_dir / f".{tag}.new-{ident}"
            os.rename(tmp, staged)
            _fsync_dir(save_dir)
            _fault_point("staged")
            old = None
            if os.path.lexists(final):
                old = save_dir / f".{tag}.old-{ident}"
                os.rename(final, old)
                _fault_point("retired")
            os.rename(staged, final)
            _fsync_dir(save_dir)
            _fault_point("committed")
            if update_latest:
                _write_latest(save_dir, tag)
                _fault_point("latest")
            if old is not None:
                _remove(old)
        except BaseException:
            recover_tag(save_dir, tag, keep=next(iter(shares)) if len(shares) == 1 else None)
            raise
    return final
