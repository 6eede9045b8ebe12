"""Whoever reads the engine's model sees current weights: evaluation, state_dict(), checkpoints and
save_16bit_model install ZenFlow's in-flight host update, while the saving run itself continues
exactly as if it had not saved, and a resumed run matches an uninterrupted one."""
import copy

import pytest
import torch

from zenflow.engine.engine import initialize

import helpers.engine_toys as toys

# Every backward runs on a thread of its own, as CUDA runs it (tests/helpers/autograd_thread.py).
pytestmark = pytest.mark.usefixtures("autograd_thread")

# The seed block (update_interval 4, overlap_step on) without reselection, which installs early:
# after 6 steps the window that ended at step 4 is in flight (it would be installed at step 8).
STEPS_IN_FLIGHT = 6


def zenflow_config(**extra):
    cfg = toys.config("zenflow", **extra)
    cfg["zero_optimization"]["zenflow"].update(select_strategy="step", select_interval=1000)
    return cfg


@pytest.fixture
def make_engine():
    engines = []

    def make(cfg=None, model=None, **kw):
        engine = initialize(model=model if model is not None else toys.make_model(),
                            config=cfg if cfg is not None else zenflow_config(), **kw)[0]
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.close()


def raw_weights(engine) -> dict:
    """The weights training runs on right now (parameters() is not hooked, state_dict() is).
    The engine finishes its installs in step(); a script that attaches its model waits for them
    before such a read (docs/semantics.md), as this does."""
    wait_for_install = getattr(engine.optimizer, "wait_for_install", None)
    if wait_for_install is not None:
        wait_for_install()
    names = [n for n, _ in engine.module.named_parameters()]
    return {n: p.detach().clone() for n, p in zip(names, engine.module.parameters())}


def synchronized_after(make_engine, steps) -> dict:
    engine = make_engine()
    toys.train(engine, range(steps))
    engine.optimizer.synchronize()
    return raw_weights(engine)


def assert_equal(a: dict, b: dict):
    assert a.keys() <= b.keys()
    for k in a:  # saved files hold CPU tensors; the engine's may live on the GPU
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def assert_differs(a: dict, b: dict):
    assert any(not torch.equal(a[k], b[k]) for k in a), "nothing was in flight: vacuous test"


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_checkpoint_holds_synchronized_weights_and_saving_changes_nothing(make_engine, tmp_path):
    current = synchronized_after(make_engine, STEPS_IN_FLIGHT)
    saver = make_engine()
    toys.train(saver, range(STEPS_IN_FLIGHT))
    before_save = raw_weights(saver)
    assert_differs(before_save, current)
    path = saver.save_checkpoint(tmp_path, client_state={"step": STEPS_IN_FLIGHT})
    assert_equal(before_save, raw_weights(saver))  # saving left the run's weights as they were
    saved = torch.load(f"{path}/model_states.pt", weights_only=True)
    assert saved.keys() == before_save.keys()  # (saver.module.state_dict() would synchronize)
    assert_equal(current, saved)

    toys.train(saver, range(STEPS_IN_FLIGHT, 12))
    uninterrupted = make_engine()
    toys.train(uninterrupted, range(12))
    assert_equal(raw_weights(uninterrupted), raw_weights(saver))

    resumed = make_engine(model=toys.make_model(seed=5))
    assert resumed.load_checkpoint(tmp_path)[1] == {"step": STEPS_IN_FLIGHT}
    assert_equal(before_save, raw_weights(resumed))  # the weights training ran on, for exactness
    toys.train(resumed, range(STEPS_IN_FLIGHT, 12))
    assert_equal(raw_weights(uninterrupted), raw_weights(resumed))

    weights_only = make_engine(model=toys.make_model(seed=6))
    weights_only.load_checkpoint(tmp_path, load_module_only=True)
    assert_equal(current, raw_weights(weights_only))


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_eval_mode_no_grad_and_state_dict_read_current_weights(make_engine):
    current = synchronized_after(make_engine, STEPS_IN_FLIGHT)
    for read in ("engine.eval", "module.eval+forward", "no_grad forward", "state_dict"):
        engine = make_engine()
        toys.train(engine, range(STEPS_IN_FLIGHT))
        assert_differs(raw_weights(engine), current)
        x, _ = toys.batch(0, 4)
        engine(x)  # a training forward leaves the overlap alone
        assert_differs(raw_weights(engine), current)
        if read == "engine.eval":
            engine.eval()
        elif read == "module.eval+forward":
            engine.module.eval()
            engine.module(x)
        elif read == "no_grad forward":
            with torch.no_grad():
                engine(x)
        else:
            assert_equal(current, engine.module.state_dict())
        assert_equal(current, raw_weights(engine))


def test_save_16bit_model_writes_synchronized_bf16_weights(make_engine, tmp_path):
    cfg = zenflow_config(bf16={"enabled": True})
    reference = make_engine(cfg)
    toys.train(reference, range(STEPS_IN_FLIGHT))
    reference.optimizer.synchronize()
    engine = make_engine(cfg)
    toys.train(engine, range(STEPS_IN_FLIGHT))
    assert_differs(raw_weights(engine), raw_weights(reference))
    assert engine.save_16bit_model(tmp_path / "export") is True
    saved = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    assert saved.keys() == engine.module.state_dict().keys()
    assert_equal(raw_weights(reference), saved)


def test_frozen_parameters_are_skipped_kept_bit_identical_and_excluded_on_request(
        make_engine, tmp_path):
    model = toys.make_model()
    model[0].requires_grad_(False)
    frozen_before = copy.deepcopy(model[0].state_dict())
    engine = make_engine(model=model)
    toys.train(engine, range(8))
    for k, v in model[0].state_dict().items():
        assert torch.equal(v, frozen_before[k]), k
    # Frozen parameters cost no host memory: the same as an optimizer over the others only.
    trainable_only = toys.make_model()
    with type(engine.optimizer)([p for i, m in enumerate(trainable_only) if i != 0
                                 for p in m.parameters()],
                                topk_ratio=engine.optimizer.topk_ratio, worker=False) as alone:
        assert engine.optimizer.stats()["host_bytes"] == alone.stats()["host_bytes"]

    path = engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    saved = torch.load(f"{path}/model_states.pt", weights_only=True)
    assert "0.weight" not in saved and "0.bias" not in saved and "3.weight" in saved
    other_model = toys.make_model()
    other_model[0].requires_grad_(False)
    other = make_engine(model=other_model)
    other.load_checkpoint(tmp_path)
    assert_equal(engine.module.state_dict(), other.module.state_dict())
