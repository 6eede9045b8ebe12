"""Deferring Ctrl-C over bookkeeping that must not be left half-done."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_deferred():
    """Hold back a Ctrl-C (SIGINT) until the block is done, then raise it: the runner's message
    bookkeeping (sequence numbers, commands unfinished) is never left half-updated by a
    KeyboardInterrupt between two of its lines. Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:   # a handler installed from C: leave it alone
        yield
        return
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    except ValueError:   # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous == signal.default_int_handler or previous == signal.SIG_DFL:
                raise KeyboardInterrupt
