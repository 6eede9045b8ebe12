"""Tickets: the completion of a batch of queued copies (zenflow/host/transfers.py returns them):
a CUDA event's, a CPU copy thread's, or already done."""
from __future__ import annotations

import threading
import time


class Ticket:
    """Completion of a batch of queued copies."""

    def __init__(self, event=None):
        self._event = event   # a torch.cuda.Event, or None when the copies were synchronous

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def events(self) -> list:
        """The CUDA events that complete it (none for synchronous copies)."""
        return [] if self._event is None else [self._event]

    def wait(self) -> float:
        """Block until done; returns the seconds spent blocked."""
        if self.done():
            return 0.0
        start = time.perf_counter()
        self._event.synchronize()
        return time.perf_counter() - start


DONE = Ticket()


class _AllTickets(Ticket):
    def __init__(self, tickets: list[Ticket]):
        super().__init__()
        self._tickets = tickets

    def done(self) -> bool:
        return all(t.done() for t in self._tickets)

    def events(self) -> list:
        return [event for t in self._tickets for event in t.events()]

    def wait(self) -> float:
        return sum(t.wait() for t in self._tickets)


def all_of(*tickets: Ticket) -> Ticket:
    """A ticket done when every one of `tickets` is."""
    pending = [t for t in tickets if t is not DONE]
    return DONE if not pending else pending[0] if len(pending) == 1 else _AllTickets(pending)


class ThreadTicket(Ticket):
    def __init__(self):
        super().__init__()
        self.landed = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.landed.is_set()

    def wait(self) -> float:
        start = time.perf_counter()
        self.landed.wait()
        if self.error is not None:
            raise RuntimeError(f"a copy between host and device failed: {self.error!r}") from self.error
        return time.perf_counter() - start
