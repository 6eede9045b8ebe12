"""What only a GPU can show (`make gpu-check` runs these; without CUDA they are skipped): the
selftest's GPU checks, held to pass, at the sizes the suite can afford."""
from __future__ import annotations

import pytest
import torch

from zenflow.tools import selftest_checks, selftest_compiled, selftest_gpu, selftest_transfers

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture
def ctx():
    return selftest_checks._Ctx(torch.device("cuda", 0), torch.float32, None, True)


@pytest.mark.parametrize("sums", ["host", "device", "bf16 device"])
def test_a_step_inside_a_window_never_waits_for_the_device(ctx, sums):
    check = selftest_transfers.no_syncs_inside_a_window(ctx, sums)
    assert check.status == "pass", check.detail


def test_a_real_model_with_attach_and_side_streams_equals_the_reference(ctx):
    for check in selftest_gpu.model(ctx):
        assert check.status == "pass", (check.name, check.detail)


def test_step_with_a_closure_and_checkpointing_finishes(ctx):
    check, = selftest_gpu.closure(ctx)
    assert check.status == "pass", check.detail


def test_a_refused_page_lock_is_cleared_and_dropped_locks_are_released(ctx):
    for check in selftest_gpu.pagelocks(ctx):
        assert check.status == "pass", (check.name, check.detail)


def test_async_transfers_equal_synchronous_ones_bit_for_bit(ctx):
    check = selftest_transfers.transfers(ctx)[0]
    assert check.status == "pass", check.detail


def test_the_compiled_factored_step_and_correction_equal_their_eager_run(ctx):
    """A matrix's step and correction, a run's, and a DDP replica's step."""
    checks = selftest_compiled.compiled(ctx)
    assert len(checks) == 3
    for check in checks:
        assert check.status == "pass", (check.name, check.detail)
