"""Fixtures only. Code the tests share is in tests/helpers/, the programs they run as child
processes in tests/programs/."""
import os
import signal

# One intra-op thread in the test process and the programs it starts (the spawned ranks set
# theirs too): the workers the tests start share the machine's cores, and OpenMP threads that
# share a core with a busy worker wait on each other, 10x slower under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
