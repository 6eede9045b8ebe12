"""The lock of one checkpoint tag, so that concurrent savers take turns and a save never swaps a
directory that another process is reading (zenflow.engine.checkpoint)."""
from __future__ import annotations

import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted."""


def _lock_holders(inode: int) -> list[int]:
    """The pids holding a lock on the file with this inode (Linux's /proc/locks; [] elsewhere)."""
    holders = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
                    holders.append(int(fields[4]))
    except (OSError, ValueError):
        pass
    return sorted(set(holders))


class TagLock:
    """The lock of one tag, `<save_dir>/.<tag>.lock`: exclusive for a saver, shared for readers
    (so that the ranks of a job load one checkpoint at once); the file is removed on release.

    With fcntl the lock dies with its holder, so a crashed saver never blocks the next one; the
    file is unlinked while still held exclusively (the last reader out upgrades to do it), and a
    waiter that wakes up on an unlinked file retries. Without fcntl (Windows) the file itself is
    the saver's lock (O_EXCL), a stale one is reported, and readers do not lock.
    """

    def __init__(self, save_dir: Path, tag: str, timeout: float = 600.0, optional: bool = False,
                 shared: bool = False):
        self.path = save_dir / f".{tag}.lock"
        self.timeout = timeout
        self.optional = optional  # a reader in a read-only directory goes on without the lock
        self.shared = shared
        self.fd: int | None = None

    def __enter__(self):
        if fcntl is None and self.shared:
            return self
        if fcntl is not None:
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError:
                    if self.optional:
                        return self
                    raise
                try:
                    self._flock(fd)
                except BaseException:
                    os.close(fd)
                    raise
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    self.fd = fd
                    return self
                os.close(fd)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                return self
            except PermissionError:
                if self.optional:
                    return self
                raise
            except FileExistsError:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"another save of this tag holds {str(self.path)!r} since more than "
                        f"{self.timeout:g} s; if no other process is saving, delete that file")
                time.sleep(0.05)

    def _flock(self, fd: int) -> None:
        """Take the lock within the timeout; a holder that keeps it longer (a stopped saver) is
        a CheckpointError naming the lock file, how long we waited and who holds it."""
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, mode)
                return
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited > self.timeout:
                    holders = _lock_holders(os.fstat(fd).st_ino)
                    raise CheckpointError(
                        f"{str(self.path)!r} has been locked by another process"
                        + (f" (pid {', '.join(map(str, holders))})" if holders else "")
                        + f" for the {waited:.0f} s this "
                        + ("load" if self.shared else "save") + " waited; a save of this tag "
                        "is stuck (stopped or hung). End or resume that process, then retry")
                time.sleep(min(0.05, self.timeout / 10))

    def __exit__(self, *exc):
        if self.fd is None:
            return
        try:
            if self.shared:  # remove the file only if no one else holds or awaits it
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(self.path)
        except BlockingIOError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None
