"""The CUDA seam's obligations that a CPU can check with stand-ins for the CUDA runtime: the
device is always explicit, failed page-locking is reported and harmless, page-locked memory is
released only once no copy uses it, and nothing rewrites a buffer a queued copy still reads."""
from __future__ import annotations

import contextlib
import logging

import torch

import zenflow
from zenflow.engine.engine import gradient_buckets
from zenflow.host.transfers import Transfers


class FakeRuntime:
    """cudart as Transfers uses it; `refuse` lists the registrations that fail (1-based)."""

    def __init__(self, calls: list, refuse=()):
        self.calls, self.refuse, self.registered = calls, set(refuse), 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered += 1
        self.calls.append(("register", ptr))
        return 2 if self.registered in self.refuse else 0   # 2: cudaErrorMemoryAllocation

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class FakeStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def synchronize(self):
        self.calls.append(("synchronize", self.name))


def _cuda_transfers(monkeypatch, calls, refuse=()):
    transfers = Transfers(torch.device("cpu"))
    transfers.cuda, transfers.device = True, torch.device("cuda", 3)
    transfers._d2h, transfers._h2d = FakeStream("d2h", calls), FakeStream("h2d", calls)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime(calls, refuse))

    @contextlib.contextmanager
    def on_device(device):
        calls.append(("device", torch.device(device)))
        yield
    monkeypatch.setattr(torch.cuda, "device", on_device)
    return transfers


def test_a_refused_page_lock_is_cleared_reported_and_left_pageable(monkeypatch, caplog):
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls, refuse={1})
    first, second = torch.zeros(256), torch.zeros(256)
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        transfers.pin([first, second])
    assert calls == [("device", torch.device("cuda", 3)), ("register", first.data_ptr()),
                     ("clear",), ("register", second.data_ptr())]
    assert transfers._pinned == [second.data_ptr()]
    assert "page-locking 1 host buffer(s)" in caplog.text and "error 2" in caplog.text


def test_unpinning_waits_for_the_copies_in_flight_first(monkeypatch):
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    transfers._pinned = [1234]
    transfers.unpin()
    assert calls == [("synchronize", "d2h"), ("synchronize", "h2d"),
                     ("device", torch.device("cuda", 3)), ("unregister", 1234)]
    assert transfers._pinned == []


class RecordingTicket:
    def __init__(self, events: list):
        self.events = events

    def done(self) -> bool:
        return False

    def wait(self) -> float:
        self.events.append("install copy waited for")
        return 0.0


def test_loading_a_state_waits_for_the_queued_install_before_rewriting_its_buffer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, bias=False)
    opt = zenflow.ZenFlowAdamW(layer.parameters(), topk_ratio=0.25, update_interval=1,
                               overlap_step=True, worker=False)
    for _ in range(3):
        layer(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    assert saved["zenflow"]["in_flight"], "the test needs an update in flight"
    events: list = []
    pipeline = opt._pipeline
    pipeline._install_reader = RecordingTicket(events)
    publish = pipeline.host.publish
    pipeline.host.publish = lambda jobs: (events.append("install buffer rewritten"),
                                          publish(jobs))
    opt.load_state_dict(saved)
    opt.close()
    assert events == ["install copy waited for", "install buffer rewritten"]


def test_gradients_are_averaged_in_buckets_not_one_model_sized_temporary():
    grads = [torch.zeros(100), torch.zeros(100), torch.zeros(300), torch.zeros(50, dtype=torch.bfloat16),
             torch.zeros(100)]
    buckets = gradient_buckets(grads, bucket_bytes=800)
    assert [[g.numel() for g in b] for b in buckets] == [[100, 100], [300], [100], [50]]
    assert all(len({g.dtype for g in b}) == 1 for b in buckets)


def test_the_fence_waits_for_every_copy_of_the_step_not_only_one(monkeypatch):
    """A step's copies may be several batches (some started in backward hooks): the compute
    stream must wait for each one's event before later work can overwrite their sources."""
    from zenflow.host.transfers import Ticket, all_of

    class FakeEvent:
        def query(self):
            return False
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    current = FakeStream("current", calls)
    current.wait_event = lambda event: calls.append(("wait", event))
    transfers._current = lambda: current
    early, late = FakeEvent(), FakeEvent()
    transfers.fence(all_of(Ticket(early), Ticket(late)))
    assert [c for c in calls if c[0] == "wait"] == [("wait", early), ("wait", late)]
