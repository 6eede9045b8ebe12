"""Checkpoints: a resumed run (in a fresh process) equals an uninterrupted one; damaged or
half-written checkpoints are refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zenflow.engine.checkpoint import CheckpointError
from zenflow.engine.engine import initialize

import helpers.engine_toys as toys
from helpers.checkpoint_variants import VARIANTS, _counters, _engine, _saved
from helpers.children import program, with_root_on_path


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """Per variant: 20 uninterrupted steps here; 10 steps, a checkpoint, and 10 more steps in
    one fresh child process that loads each checkpoint (tests/programs/checkpoint_resume.py; one
    process for all variants: each python start-up with torch costs seconds)."""
    root = tmp_path_factory.mktemp("resume")
    expected = {}
    for variant in VARIANTS:
        whole = _engine(variant)
        toys.train(whole, range(20))
        whole.synchronize()
        expected[variant] = (toys.weights(whole.module), _counters(whole))
        whole.close()

        first = _engine(variant)
        toys.train(first, range(10))
        first.save_checkpoint(root / variant, client_state={"note": "step 10"})
        first.close()
        assert (root / variant / "latest").read_text() == "global_step10"
    # Same intra-op thread count as here, so that the child's kernels reduce in the same order.
    env = with_root_on_path(OMP_NUM_THREADS=str(torch.get_num_threads()))
    run = subprocess.run([sys.executable, str(program("checkpoint_resume.py")), str(root),
                          *VARIANTS], capture_output=True, text=True, timeout=600, env=env)
    return root, expected, run


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_in_a_fresh_process_equals_uninterrupted_run(resumed_runs, variant):
    root, expected, run = resumed_runs
    assert run.returncode == 0, run.stderr[-3000:]
    weights, counters = expected[variant]
    resumed = torch.load(root / f"{variant}.resumed.pt")
    for name, value in weights.items():
        assert torch.equal(resumed[name], value), f"{variant}: {name} differs after resume"
    assert json.load(open(root / f"{variant}.resumed.json")) == json.loads(json.dumps(counters))


def test_round_trip_restores_counters_schedule_scaler_and_rng(tmp_path):
    a = _engine("adamw-fp16-warmup")
    toys.train(a, range(7))
    a.save_checkpoint(tmp_path, tag="mine", client_state={"epoch": 3})
    after_save = torch.rand(4)
    b = _engine("adamw-fp16-warmup", model_seed=1)
    torch.manual_seed(123)
    path, client = b.load_checkpoint(tmp_path)
    assert Path(path) == tmp_path / "mine" and client == {"epoch": 3}
    assert torch.equal(torch.rand(4), after_save)  # the RNG continues where it was saved
    assert _counters(b) == _counters(a)
    assert b.lr_scheduler.last_batch_iteration == a.lr_scheduler.last_batch_iteration
    assert b.loss_scaler.state_dict() == a.loss_scaler.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(b.module.state_dict().values(),
                                                 a.module.state_dict().values()))
    for pa, pb in zip(a.optimizer.state_dict()["state"].values(),
                      b.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_truncated_file_is_rejected(tmp_path):
    engine, path = _saved(tmp_path)
    f = path / "optimizer_states.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or damaged: optimizer_states.pt has"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_missing_manifest_is_rejected(tmp_path):
    engine, path = _saved(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: it has no manifest.json"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_missing_file_and_flipped_byte_are_rejected(tmp_path):
    engine, path = _saved(tmp_path)
    f = path / "model_states.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 of model_states.pt"):
        engine.load_checkpoint(tmp_path / "ckpt")
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    engine.load_checkpoint(tmp_path / "ckpt")  # repaired: loads again
    (path / "engine_states.pt").unlink()
    with pytest.raises(CheckpointError, match="engine_states.pt is missing"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_failed_load_leaves_the_engine_untouched(tmp_path):
    engine, path = _saved(tmp_path)
    before, counters = toys.weights(engine.module), _counters(engine)
    (path / "optimizer_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert _counters(engine) == counters
    assert all(torch.equal(before[k], v) for k, v in toys.weights(engine.module).items())


@pytest.mark.slow   # a child process
def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, str(program("checkpoint_crash_while_saving.py")),
                          str(ckpt)], capture_output=True, text=True, timeout=300,
                         env=with_root_on_path())
    assert run.returncode == 9, run.stderr[-3000:]
    assert (ckpt / "latest").read_text() == "global_step3"
    assert not (ckpt / "global_step6").exists()
    assert any(p.name.startswith(".global_step6.tmp-") for p in ckpt.iterdir())
    engine = _engine("adamw", model_seed=7)
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == 3
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_checkpoint(ckpt, tag="global_step6")


def test_no_checkpoint_and_bad_tags(tmp_path):
    engine = _engine("adamw")
    # As DeepSpeed: a directory without a `latest` checkpoint loads nothing and says so.
    assert engine.load_checkpoint(tmp_path) == (None, None)
    assert engine.global_steps == 0
    for tag in ("../escape", ".hidden", "latest", ""):
        with pytest.raises(ValueError, match="checkpoint tag"):
            engine.save_checkpoint(tmp_path, tag=tag)


def test_saving_the_same_tag_twice_replaces_it(tmp_path):
    engine = _engine("adamw")
    toys.train(engine, range(2))
    engine.save_checkpoint(tmp_path, tag="t")
    toys.train(engine, range(2, 4))
    engine.save_checkpoint(tmp_path, tag="t")
    other = _engine("adamw", model_seed=3)
    other.load_checkpoint(tmp_path, tag="t")
    assert other.global_steps == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]


def test_checkpoint_of_another_optimizer_is_refused_unless_weights_only(tmp_path):
    engine, _ = _saved(tmp_path)
    off = _engine("offload")
    with pytest.raises(ValueError, match="written with AdamW, this engine runs OffloadAdamW"):
        off.load_checkpoint(tmp_path / "ckpt")
    off.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
    assert all(torch.equal(a, b) for a, b in zip(off.module.state_dict().values(),
                                                 engine.module.state_dict().values()))
    assert off.global_steps == 0
    off.close()


def test_a_failed_load_changes_no_tensor(tmp_path):
    """Checked before anything is copied: an optimizer state that does not fit (another
    topk_ratio) and weights of another shape each leave the model exactly as it was."""
    import copy as _copy
    saver, *_ = initialize(model=toys.make_model(seed=0), config=toys.config("zenflow"))
    toys.train(saver, range(3))
    saver.save_checkpoint(tmp_path / "ckpt")
    saver.close()

    cfg = toys.config("zenflow")
    cfg["zero_optimization"]["zenflow"]["topk_ratio"] = 0.5
    other, *_ = initialize(model=toys.make_model(seed=7), config=cfg)
    before = _copy.deepcopy(other.module.state_dict())
    with pytest.raises(ValueError, match="topk_ratio"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(v, before[k]) for k, v in other.module.state_dict().items())
    assert other.global_steps == 0
    other.close()

    wider = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(2)])
    narrow, *_ = initialize(model=wider, config=toys.config("adamw"))
    before = _copy.deepcopy(narrow.module.state_dict())
    with pytest.raises(ValueError, match="nothing was loaded"):
        narrow.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
    assert all(torch.equal(v, before[k]) for k, v in narrow.module.state_dict().items())
    narrow.close()
