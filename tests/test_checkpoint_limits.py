"""Saves under Ctrl-C and a full disk, leftovers of failed data-parallel saves, tags that could
not be loaded back, and a stuck saver's lock (issue 24, items 10, 13 and 15)."""
import os
import signal
import threading

import pytest
import torch

from zenflow.engine import checkpoint
from zenflow.engine.checkpoint import write_checkpoint
from zenflow.engine.checkpoint_lock import CheckpointError, TagLock
from zenflow.engine.checkpoint_read import read_checkpoint

BIG = {"w": torch.arange(1 << 20, dtype=torch.float32)}   # 4 MiB: torch writes it in pieces


def _save(root, version, tag="t"):
    return write_checkpoint(root, tag, {"x.pt": {"version": version, **BIG}},
                            meta={"version": version})


def test_ctrl_c_while_torch_writes_raises_keyboard_interrupt(tmp_path, monkeypatch,
                                                              ctrl_c_raises):
    """A real SIGINT while torch.save is inside its C++ writer: KeyboardInterrupt (not torch's
    "unexpected pos" RuntimeError), and the previous checkpoint stays intact (item 13)."""
    _save(tmp_path, 1)
    writes = []

    def sigint_on_third_write(stage):
        if stage == "writing":
            writes.append(stage)
            if len(writes) == 3:
                os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(checkpoint, "_fault_point", sigint_on_third_write)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    monkeypatch.undo()
    _, _, objs = read_checkpoint(tmp_path, None, ["x.pt"])
    assert objs["x.pt"]["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]


def test_full_disk_names_enospc(tmp_path):
    """A write that hits a full disk (/dev/full) raises an OSError naming ENOSPC and the file."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    target = tmp_path / "x.pt"
    target.symlink_to("/dev/full")
    with pytest.raises(OSError, match="ENOSPC") as caught:
        checkpoint._save_object(target, BIG)
    assert "unexpected pos" not in str(caught.value) and str(target) in str(caught.value)


@pytest.mark.parametrize("tag", [" t", "t ", "t\n", "a\tb", "x" * 300])
def test_tags_that_could_not_be_loaded_back_are_refused_by_name(tmp_path, tag):
    with pytest.raises(ValueError, match="checkpoint tag"):
        _save(tmp_path, 1, tag=tag)
    assert not any(tmp_path.iterdir())


def test_failed_data_parallel_save_leftovers_are_removed_by_the_next_save(tmp_path):
    """`.<tag>.shares-<id>/` of a save whose rank died is removed by the next save (item 15)."""
    stale = tmp_path / f".t.shares-{'0' * 32}"
    stale.mkdir()
    (stale / "rank1_states.pt").write_bytes(b"partial")
    _save(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]


def test_a_stuck_savers_lock_is_an_error_naming_it(tmp_path):
    """A saver that holds a tag's lock and never lets go (stopped): a load of that tag fails
    after the lock's deadline, naming the lock file and the holder (item 10)."""
    _save(tmp_path, 1)
    import fcntl
    holder = os.open(tmp_path / ".t.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    outcome = []

    def load():
        try:
            with TagLock(tmp_path, "t", timeout=0.5, shared=True):
                outcome.append("locked")
        except CheckpointError as exc:
            outcome.append(exc)
    try:
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        thread.join(20)
    finally:
        os.close(holder)
    assert outcome and isinstance(outcome[0], CheckpointError), outcome or "hung"
    assert ".t.lock" in str(outcome[0]) and f"pid {os.getpid()}" in str(outcome[0])


def test_a_tag_that_is_a_symbolic_link_is_overwritten_and_its_target_kept(tmp_path):
    """`best` made a link to another checkpoint by hand, then saved as a tag: the save
    succeeds without an error, `best` holds the new checkpoint, the checkpoint the link pointed
    at is untouched, and no `.best.old-*` is left behind (issue 39, item 11)."""
    _save(tmp_path, 1, tag="step_1")
    os.symlink(tmp_path / "step_1", tmp_path / "best")
    _save(tmp_path, 2, tag="best")
    assert not (tmp_path / "best").is_symlink()
    _, _, objs = read_checkpoint(tmp_path, "best", ["x.pt"])
    assert objs["x.pt"]["version"] == 2
    _, _, objs = read_checkpoint(tmp_path, "step_1", ["x.pt"])
    assert objs["x.pt"]["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "step_1"]
