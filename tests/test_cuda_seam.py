"""The CUDA seam's obligations that a CPU can check with stand-ins for the CUDA runtime: the
device is always explicit, failed page-locking is reported and harmless, page-locked memory is
released only once no copy uses it, and nothing rewrites a buffer a queued copy still reads."""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref

import pytest
import torch

import zenflow
from zenflow.engine.gradient_averaging import gradient_buckets
from zenflow.host import page_locks
from zenflow.host.page_locks import PageLocks
from zenflow.host.transfers import Transfers

# What torch.cuda.cudart() binds (torch/csrc/cuda/shared/cudart.cpp, PyTorch 2.4 to 2.13): no
# cudaGetLastError. A stand-in that answers more hides a call the real runtime cannot answer.
CUDART_BINDING = {"cudaGetErrorString", "cudaProfilerStart", "cudaProfilerStop",
                  "cudaHostRegister", "cudaHostUnregister", "cudaStreamCreate",
                  "cudaStreamDestroy", "cudaMemGetInfo"}


class FakeRuntime:
    """cudart as the seam uses it, and nothing torch's binding lacks; `refuse` lists the
    registrations that fail (1-based)."""

    def __init__(self, calls: list, refuse=()):
        self.calls, self.refuse, self.registered = calls, set(refuse), 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered += 1
        self.calls.append(("register", ptr))
        return 2 if self.registered in self.refuse else 0   # 2: cudaErrorMemoryAllocation

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_the_stand_in_runtime_binds_nothing_torchs_lacks():
    assert {name for name in dir(FakeRuntime) if name.startswith("cuda")} <= CUDART_BINDING


class FakeStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def synchronize(self):
        self.calls.append(("synchronize", self.name))


def _cuda_transfers(monkeypatch, calls, refuse=()):
    transfers = Transfers(torch.device("cpu"))
    transfers.cuda, transfers.device = True, torch.device("cuda", 3)
    transfers._d2h, transfers._h2d = FakeStream("d2h", calls), FakeStream("h2d", calls)
    transfers._locks = PageLocks(transfers.device, (transfers._d2h, transfers._h2d))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime(calls, refuse))
    monkeypatch.setattr(page_locks, "clear_last_cuda_error",
                        lambda device: calls.append(("clear", device)))

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
    device = torch.device("cuda", 3)
    assert calls == [("device", device), ("register", first.data_ptr()), ("clear", device),
                     ("register", second.data_ptr())]
    assert [t.data_ptr() for t in transfers._locks.buffers] == [second.data_ptr()]
    assert transfers.pinned_bytes == 256 * 4
    assert "page-locking 1 host buffer(s)" in caplog.text and "error 2" in caplog.text


def test_unpinning_waits_for_the_copies_in_flight_first(monkeypatch):
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    buffer = torch.zeros(16)
    transfers.pin([buffer])
    calls.clear()
    transfers.unpin()
    assert calls == [("synchronize", "d2h"), ("synchronize", "h2d"),
                     ("device", torch.device("cuda", 3)), ("unregister", buffer.data_ptr())]
    assert transfers.pinned_bytes == 0
    transfers.unpin()
    assert len(calls) == 4   # once


def test_a_transfer_path_dropped_without_close_unlocks_its_buffers(monkeypatch):
    """HF Trainer and Lightning never close() an optimizer: its page-locked buffers (about
    90 GiB at 7B) are unlocked when it is collected, after its copies, and their memory stays
    mapped until then."""
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    buffer = torch.zeros(16)
    ptr = buffer.data_ptr()
    transfers.pin([buffer])
    locks = weakref.ref(transfers._locks)
    del buffer, transfers
    gc.collect()
    assert locks() is None
    assert calls[-4:] == [("synchronize", "d2h"), ("synchronize", "h2d"),
                          ("device", torch.device("cuda", 3)), ("unregister", ptr)]


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


def test_work_after_an_install_copy_runs_on_the_copy_stream_inside_its_ticket(monkeypatch):
    """to_device's `then` (DDP's correction and all-gather of an install) is queued on the copy
    stream after the copies, and the ticket's event is recorded after it: a layer that waits for
    the ticket waits for the gather too; nothing of it runs on the compute stream."""
    from zenflow.host import transfers as transfers_module
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    compute = FakeStream("compute", calls)
    transfers._current = lambda: compute
    h2d = transfers._h2d
    h2d.wait_stream = lambda other: calls.append(("wait", "h2d", other.name))
    h2d.record_event = lambda: calls.append(("event", "h2d")) or "installed"
    current = ["compute"]

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream.name)
        yield
        current.pop()
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(transfers_module, "copy", lambda dst, src, non_blocking=False: calls.append(
        ("copy", current[-1], non_blocking)))

    class Destination:
        def record_stream(self, stream):
            calls.append(("record", stream.name))
    ticket = transfers.to_device([(Destination(), torch.zeros(4))],
                                 then=lambda: calls.append(("then", current[-1])))
    assert calls == [("wait", "h2d", "compute"), ("copy", "h2d", True), ("record", "h2d"),
                     ("then", "h2d"), ("event", "h2d")]
    assert ticket.events() == ["installed"]


def _locked_by_region(monkeypatch, **settings) -> dict[str, int]:
    """The bytes of each host region handed to page-locking over an optimizer's first steps."""
    spans: list[torch.Tensor] = []
    monkeypatch.setattr(Transfers, "pin", lambda self, tensors: spans.extend(tensors))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16),
                                torch.nn.Linear(16, 8))
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2,
                               worker=False, **settings)
    with opt:
        for _ in range(3):
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        arena = opt._pipeline.host.arena
        out: dict[str, int] = {}
        for t in spans:
            region = next(r for r in arena.regions
                          if arena.views[r.name].data_ptr() <= t.data_ptr()
                          < arena.views[r.name].data_ptr() + r.nbytes)
            out[region.name] = out.get(region.name, 0) + t.numel() * t.element_size()
    return out


def test_page_locks_cover_only_what_the_placement_copies(monkeypatch):
    """The install buffer and the steps' factors always; the staging buffers only over the
    matrices summed on the host, the sum buffers only over those summed on the device."""
    weights = [64 * 32, 32 * 16, 16 * 8]
    on_device = _locked_by_region(monkeypatch, device_sum_budget=10 ** 9,
                                  deferred_credit="moments")
    assert on_device == {"step_coef": 4, "install_float32": 4 * sum(weights),
                         "rate_float32": 4 * sum(weights),   # "moments": the rates cross too
                         "grad_sum0": 4 * sum(weights), "grad_sum1": 4 * sum(weights)}
    # "factored" (the default): its row and column statistics and factors, 2 R + 3 C fp32
    factored = _locked_by_region(monkeypatch, device_sum_budget=10 ** 9)
    assert factored == {"step_coef": 4, "install_float32": 4 * sum(weights),
                        "factors": 4 * (2 * (32 + 16 + 8) + 3 * (64 + 32 + 16)),
                        "grad_sum0": 4 * sum(weights), "grad_sum1": 4 * sum(weights)}
    on_host = _locked_by_region(monkeypatch, device_sum_budget=0)
    assert on_host == {"step_coef": 4, "install_float32": 4 * sum(weights),
                       "staging0_float32": 4 * sum(weights)}
    # a budget for the first weight's sum only: the others cross every step
    split = _locked_by_region(monkeypatch, device_sum_budget=4 * weights[0],
                              deferred_credit="mean")
    assert split == {"step_coef": 4, "install_float32": 4 * sum(weights),
                     "grad_sum0": 4 * weights[0], "grad_sum1": 4 * weights[0],
                     "staging0_float32": 4 * sum(weights[1:])}


def _fake_device_memory(monkeypatch, total, reserved_peak, allocated_peak, allocated_now):
    gib = 2 ** 30
    props = type("Props", (), {"total_memory": total * gib})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: reserved_peak * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated_peak * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated_now * gib)


def test_auto_budget_leaves_room_for_the_activations_to_double(monkeypatch):
    """device_sum_budget="auto" is measured at the first step: a later batch twice as long
    needs twice its activations (18 GiB here: a peak of 48 GiB allocated, 30 at step()), which
    the sums must not have taken (80 GiB device, 10% headroom, 50 GiB reserved at the peak)."""
    calls: list = []
    transfers = _cuda_transfers(monkeypatch, calls)
    _fake_device_memory(monkeypatch, total=80, reserved_peak=50, allocated_peak=48,
                        allocated_now=30)
    assert transfers.spare_device_bytes() == int(80 * 0.9 * 2 ** 30) - 50 * 2 ** 30 - 18 * 2 ** 30


def test_auto_placed_sums_warn_once_when_the_device_fills_up(monkeypatch, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1,
                               worker=False, device_sum_budget="auto", deferred_credit="mean")
    peak = [10]
    monkeypatch.setattr(Transfers, "spare_device_bytes", lambda self: 10 ** 9)
    monkeypatch.setattr(Transfers, "device_memory", lambda self: (peak[0] * 2 ** 30, 80 * 2 ** 30))
    with opt, caplog.at_level(logging.WARNING, logger="zenflow"):
        for step in range(6):
            peak[0] = 10 if step < 3 else 77   # a longer batch at step 3
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.stats()["device_sum_matrices"] == 2
    warnings = [r for r in caplog.records if "peak memory has reached" in r.message]
    assert len(warnings) == 1 and "77.0 of 80.0 GiB" in warnings[0].message


def test_a_windows_work_is_timed_on_the_device_less_its_install_waits(monkeypatch):
    """On CUDA a window's own work is timed by two events on the current stream, read once the
    later has completed (never synchronized), less the install waits timed inside it."""
    events: list = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.done = None, False
            events.append(self)

        def record(self, stream):
            assert stream.name == "compute"
            self.at = clock[0]

        def query(self):
            return self.done

        def elapsed_time(self, later):   # milliseconds, as torch's
            assert self.done and later.done
            return (later.at - self.at) * 1000.0
    calls: list = []
    clock = [0.0]
    transfers = _cuda_transfers(monkeypatch, calls)
    compute = FakeStream("compute", calls)

    def wait_event(event):   # the device waits 0.1 s for the install's copy
        calls.append(("wait", event))
        clock[0] += 0.1
    compute.wait_event = wait_event
    transfers._current = lambda: compute
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    from zenflow.host.transfers import Ticket
    with transfers.window_work(ends=True):
        clock[0] = 0.25
        transfers.order_after([Ticket(FakeEvent(enable_timing=True))])
        clock[0] = 1.0
    assert transfers.last_window_work_seconds == 0.0     # not completed: not read, not waited
    assert not any(c[0] == "synchronize" for c in calls)
    for event in events:
        event.done = True
    assert transfers.last_window_work_seconds == pytest.approx(0.9)
    assert transfers.last_install_wait_seconds == pytest.approx(0.1)
