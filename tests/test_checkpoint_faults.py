"""Checkpoints under faults and hostile input: an overwrite interrupted at any point (Ctrl-C or
a hard crash) leaves `latest` naming a complete checkpoint; concurrent savers of one tag take
turns; a planted pickle is refused and runs nothing; a malformed manifest is a CheckpointError."""
import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from zenflow.engine import checkpoint
from zenflow.engine.checkpoint import CheckpointError, write_checkpoint
from zenflow.engine.checkpoint_lock import TagLock
from zenflow.engine.checkpoint_read import read_checkpoint, verify_checkpoint

import helpers.checkpoint_variants as tc
import helpers.engine_toys as toys

STAGES = ["written", "staged", "retired", "committed", "latest"]
# Which version the tag holds after an overwrite stopped at each stage: before the old
# version is renamed away the new one is dropped; from then on the new one is kept.
SURVIVOR = {"written": 1, "staged": 1, "retired": 2, "committed": 2, "latest": 2}


def _save(root, version, tag="t"):
    return write_checkpoint(root, tag, {"x.pt": {"version": version, "w": torch.full((8,), version)}},
                            meta={"version": version})


def _version(root, tag=None):
    path, manifest, objs = read_checkpoint(root, tag, ["x.pt"])
    assert objs["x.pt"]["version"] == manifest["meta"]["version"]
    assert torch.equal(objs["x.pt"]["w"], torch.full((8,), manifest["meta"]["version"]))
    return objs["x.pt"]["version"]


def _fail_at(stage, action):
    def hook(name):
        if name == stage:
            action()
    return hook


def _listing(root):
    return sorted(p.name for p in Path(root).iterdir())


@pytest.mark.parametrize("stage", STAGES)
def test_interrupted_overwrite_keeps_a_complete_checkpoint(tmp_path, stage, monkeypatch):
    _save(tmp_path, 1)

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_fault_point", _fail_at(stage, interrupt))
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "t"
    verify_checkpoint(tmp_path / "t")
    assert _version(tmp_path) == SURVIVOR[stage]
    assert _listing(tmp_path) == ["latest", "t"]  # nothing leaked, the lock released
    monkeypatch.undo()
    _save(tmp_path, 3)
    assert _version(tmp_path) == 3 and _listing(tmp_path) == ["latest", "t"]


def _crash_in_child(stage, fn):
    """Run fn in a forked child that dies (os._exit, no cleanup) at `stage`."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            checkpoint._fault_point = _fail_at(stage, lambda: os._exit(9))
            fn()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 9


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("stage", STAGES)
def test_crash_during_overwrite_keeps_a_complete_checkpoint(tmp_path, stage):
    _save(tmp_path, 1)
    _save(tmp_path, 1, tag="other")
    _crash_in_child(stage, lambda: _save(tmp_path, 2, tag="other"))
    # `latest` names a tag; loading it (which finishes or undoes the interrupted overwrite of
    # that tag if the crash came between the renames) gives a complete checkpoint.
    latest = (tmp_path / "latest").read_text()
    assert latest == "other"
    assert _version(tmp_path) == SURVIVOR[stage]
    verify_checkpoint(tmp_path / "other")
    assert _version(tmp_path, "t") == 1  # the other tag is untouched
    _save(tmp_path, 3, tag="other")  # the next save clears what the crash left behind
    assert _listing(tmp_path) == ["latest", "other", "t"]
    assert _version(tmp_path) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_crash_during_first_save_of_a_tag_keeps_latest(tmp_path):
    _save(tmp_path, 1)
    _crash_in_child("staged", lambda: _save(tmp_path, 2, tag="new"))
    assert (tmp_path / "latest").read_text() == "t" and _version(tmp_path) == 1
    assert not (tmp_path / "new").exists()
    # Its files were complete and fsynced when it died: loading that tag commits it.
    assert _version(tmp_path, "new") == 2
    assert _listing(tmp_path) == ["latest", "new", "t"]
    _crash_in_child("written", lambda: _save(tmp_path, 3, tag="newer"))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path, "newer", ["x.pt"])  # half-written: never loaded
    _save(tmp_path, 4, tag="newer")
    assert _listing(tmp_path) == ["latest", "new", "newer", "t"]


def test_interrupted_overwrite_through_the_engine(tmp_path, monkeypatch):
    engine = tc._engine("adamw")
    toys.train(engine, range(2))
    engine.save_checkpoint(tmp_path, tag="t")
    toys.train(engine, range(2, 4))

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_fault_point", _fail_at("retired", interrupt))
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path, tag="t")
    monkeypatch.undo()
    other = tc._engine("adamw", model_seed=3)
    other.load_checkpoint(tmp_path)
    assert other.global_steps == 4  # the new checkpoint was complete: it was kept
    assert all(torch.equal(a, b) for a, b in zip(other.module.state_dict().values(),
                                                 engine.module.state_dict().values()))
    assert _listing(tmp_path) == ["latest", "t"]


def test_concurrent_savers_of_one_tag_take_turns(tmp_path):
    errors, saved = [], []

    def saver(thread):
        for i in range(10):
            version = thread * 100 + i
            try:
                _save(tmp_path, version)
                saved.append(version)
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                errors.append(repr(exc))

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(saved) == 40
    assert _listing(tmp_path) == ["latest", "t"]
    assert _version(tmp_path) in saved


def test_a_reader_never_sees_a_half_swapped_tag(tmp_path):
    _save(tmp_path, 0)
    errors, seen = [], []
    done = threading.Event()

    def reader():
        while not done.is_set():
            try:
                seen.append(_version(tmp_path))
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for v in range(1, 16):
            _save(tmp_path, v)
    finally:
        done.set()
        thread.join()
    assert errors == [] and seen


# --------------------------------------------------------------------------------------------
# Loading never runs code.

class _Planted:
    """Unpickling this runs `touch <marker>`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(path: Path, name: str, obj):
    """Replace `name` in the checkpoint and fix the manifest, as an attacker would."""
    torch.save(obj, path / name)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"size": (path / name).stat().st_size,
                               "sha256": checkpoint.file_sha256(path / name)}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["engine_states.pt", "optimizer_states.pt", "model_states.pt"])
def test_planted_pickle_is_refused_and_runs_nothing(tmp_path, name):
    engine, path = tc._saved(tmp_path)
    marker = tmp_path / "pwned"
    original = torch.load(path / name, weights_only=True)
    _plant(path, name, {"payload": _Planted(marker), **original})
    verify_checkpoint(path)  # the checksums match: only the loader can stop it
    before, counters = toys.weights(engine.module), tc._counters(engine)
    with pytest.raises(CheckpointError, match=rf"{name}.*GLOBAL posix.system.*weights_only=True"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()
    assert tc._counters(engine) == counters
    assert all(torch.equal(before[k], v) for k, v in toys.weights(engine.module).items())


def test_saving_unloadable_client_state_is_refused_before_writing(tmp_path):
    engine, path = tc._saved(tmp_path)
    with pytest.raises(CheckpointError, match="numpy.ndarray.*weights-only load refuses"):
        engine.save_checkpoint(tmp_path / "ckpt", tag="bad", client_state={"a": np.zeros(3)})
    assert _listing(tmp_path / "ckpt") == ["global_step3", "latest"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"


def test_rng_states_are_plain_data_and_restored(tmp_path):
    engine = tc._engine("adamw")
    np.random.seed(11)
    random.seed(12)
    engine.save_checkpoint(tmp_path, tag="r")
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)],
                np.random.randn(2))  # randn exercises numpy's cached gaussian
    torch.load(tmp_path / "r" / "engine_states.pt", weights_only=True)
    np.random.seed(0)
    random.seed(0)
    torch.manual_seed(0)
    engine.load_checkpoint(tmp_path)
    got = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)],
           np.random.randn(2))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and np.array_equal(got[3], expected[3])


# --------------------------------------------------------------------------------------------
# A malformed manifest or `latest` is a CheckpointError naming what is wrong.

MANIFESTS = [
    (lambda m: dict(m, files=list(m["files"])), "files must be an object"),
    (lambda m: dict(m, files={"x.pt": {"sha256": m["files"]["x.pt"]["sha256"]}}),
     r"files\['x.pt'\].size must be a byte count"),
    (lambda m: dict(m, files={"x.pt": {"size": "12", "sha256": "0" * 64}}),
     r"files\['x.pt'\].size must be a byte count .* got '12'"),
    (lambda m: dict(m, files={"x.pt": {"size": True, "sha256": "0" * 64}}), "size must be"),
    (lambda m: dict(m, files={"x.pt": {"size": 1}}), r"files\['x.pt'\].sha256 must be 64 hex"),
    (lambda m: dict(m, files={"x.pt": 7}), r"files\['x.pt'\] must be an object"),
    (lambda m: dict(m, files={"../x.pt": m["files"]["x.pt"]}), "plain file name"),
    (lambda m: dict(m, meta=[1]), "meta must be an object"),
    (lambda m: dict(m, format="other/9"), "format must be 'zenflow-checkpoint/1'"),
    (lambda m: [m], "must hold a JSON object, got list"),
    (lambda m: {k: v for k, v in m.items() if k != "files"}, "files must be an object"),
]


@pytest.mark.parametrize("edit, message", MANIFESTS)
def test_malformed_manifest_is_a_checkpoint_error(tmp_path, edit, message):
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(edit(manifest)))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(tmp_path, None, ["x.pt"])


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"[" * 100_000, b"{\"files\": ",
                                     "{}".encode("utf-16")])
def test_unreadable_manifest_is_a_checkpoint_error(tmp_path, content):
    path = _save(tmp_path, 1)
    (path / "manifest.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="unreadable manifest.json"):
        read_checkpoint(tmp_path, None, ["x.pt"])


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"../etc", b"", b".hidden"])
def test_bad_latest_is_a_checkpoint_error(tmp_path, content):
    _save(tmp_path, 1)
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match="must hold the name of a checkpoint directory"):
        read_checkpoint(tmp_path, None, ["x.pt"])


def test_readers_share_the_tag_lock_and_a_saver_waits_for_them(tmp_path):
    _save(tmp_path, 1)
    saved = threading.Event()
    with TagLock(tmp_path, "t", shared=True):
        # Another reader (another rank loading the same checkpoint) is not held up...
        reader = threading.Thread(target=lambda: _version(tmp_path))
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive()
        # ...but a save of the tag waits until the reading is over.
        saver = threading.Thread(target=lambda: (_save(tmp_path, 2), saved.set()))
        saver.start()
        assert not saved.wait(timeout=0.5)
    saver.join(timeout=30)
    assert saved.is_set() and _version(tmp_path) == 2
    assert _listing(tmp_path) == ["latest", "t"]
