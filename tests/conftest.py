"""Fixtures only. Code the tests share is in tests/helpers/, the programs they run as child
processes in tests/programs/."""
import signal

import pytest
import torch


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test. A shell starts its background
    jobs (`make test &`, nohup) with SIGINT ignored, and Python then keeps it ignored: a test of
    what Ctrl-C does needs the handler an interactive run has."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def autograd_thread():
    """Every backward of the test runs on a thread of its own, as CUDA's autograd engine runs it
    (tests/helpers/autograd_thread.py). Yields the backward threads' idents."""
    from helpers.autograd_thread import backward_on_another_thread
    with backward_on_another_thread() as idents:
        yield idents
