"""The host update as one pass over the state, chunk by chunk (zenflow/host/buffers.py): bit for bit
what the update computed as separate passes (a whole-run AdamW kernel, then the rates, then the
install values), whatever the chunking, the thread count or the NUMA shares; and each chunk's
work done before the next chunk is touched."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zenflow.host import buffers
from zenflow.host.buffers import HostState
from zenflow.host.layout import HostLayout

from helpers.host_update import JOBS, _host, _job, _results, _update_in_passes


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# 64-element pieces: thousands of chunks handed between the threads (seconds, not milliseconds)
@pytest.mark.parametrize("piece", [pytest.param(64, marks=pytest.mark.slow), 1 << 10, buffers.PIECE])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_one_pass_update_equals_the_update_in_passes(piece, threads, monkeypatch):
    monkeypatch.setattr(buffers, "PIECE", piece)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        old, new = _host(), _host()
        _update_in_passes(old, JOBS, 0)
        new.update(JOBS, 0)
        _assert_same(_results(old), _results(new))
        # and a publish after a load rebuilds the same install buffer and rates
        for view in new.arena.views.values():
            if view.dtype != torch.float32:
                view.zero_()
        new.publish(JOBS)
        _assert_same(_results(old), _results(new))
    finally:
        torch.set_num_threads(before)


def test_chunks_follow_the_shares_on_vector_boundaries(monkeypatch):
    monkeypatch.setattr(buffers, "PIECE", 128)
    # a run of 1000 elements at 100, shares cut at 512: the cut moves back to 100 + 384
    assert buffers.chunks(100, 1000, [0, 512, 4096], [1, 2]) == [
        (0, 100, 228), (0, 228, 356), (0, 356, 484), (1, 484, 740), (1, 740, 996),
        (1, 996, 1100)]
    assert buffers.chunks(100, 10, [0, 512, 4096], [1, 1]) == [(0, 100, 110)]
    assert buffers.chunks(600, 10, [0, 512, 4096], [1, 1]) == [(1, 600, 610)]


class _Touches(TorchDispatchMode):
    """The byte ranges of one buffer each operator touches, in order."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.lo, self.hi = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
        self.ranges: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:   # taking a view reads nothing
            return func(*args, **(kwargs or {}))
        found = []

        def visit(x):
            if isinstance(x, torch.Tensor) and self.lo <= x.data_ptr() < self.hi:
                found.append((x.data_ptr(), x.data_ptr() + x.nbytes))
            elif isinstance(x, (list, tuple)):
                for y in x:
                    visit(y)
        visit(list(args) + list((kwargs or {}).values()))
        self.ranges += found
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("job", [_job(0, lookahead=1.0), _job(0, moments=True), _job(0)])
def test_each_chunk_is_finished_before_the_next(job, monkeypatch):
    monkeypatch.setattr(buffers, "PIECE", 1024)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    host = HostState.allocate(HostLayout.build([(64, 1000, torch.bfloat16)], sum_slots=2,
                                               rates=True))
    try:
        host.arena.views["exp_avg_sq"].fill_(1e-4)
        touches = _Touches(host.arena.views["master"])
        with touches:
            host.update([job], 0)
        assert touches.ranges, "the update read no master value"
        # every operator on master values sees at most a chunk, and never one it has left
        assert max(end - start for start, end in touches.ranges) <= 1024 * 4
        starts = [start for start, _ in touches.ranges]
        assert starts == sorted(starts)
        assert len(set(starts)) == -(-64 * 1000 // 1024)
    finally:
        torch.set_num_threads(before)
