"""The backward where CUDA runs it: on a thread of its own, while the calling thread waits.

On CUDA, `loss.backward()` hands the graph to autograd's per-device thread and blocks until it is
done, so every post-accumulate-grad hook, every tensor hook and every forward that activation
checkpointing recomputes runs on that thread, while the caller still holds whatever it held (an
optimizer's lock inside `step(closure)`, say). On a CPU the backward runs on the calling thread,
where a re-entrant lock is simply taken again, so a hook that would wait forever on a GPU passes.
`backward_on_another_thread()` makes the CPU behave like CUDA here: each backward (nested ones too:
reentrant checkpointing calls backward from inside the backward) runs on a new thread with the
caller's grad mode, and a backward that does not finish within `deadline` seconds raises instead
of hanging the suite (the stuck thread then finishes once the caller lets go of its lock).
"""
from __future__ import annotations

import contextlib
import threading

import torch


class BackwardHung(AssertionError):
    pass


@contextlib.contextmanager
def backward_on_another_thread(deadline: float = 30.0):
    """Within the block, torch.autograd.backward (and so Tensor.backward) runs on another thread.
    Yields the list of the threads' idents, one per backward."""
    original = torch.autograd.backward
    idents: list[int] = []

    def backward(*args, **kwargs):
        outcome: dict = {}
        grad_enabled = torch.is_grad_enabled()

        def run():
            idents.append(threading.get_ident())
            try:
                with torch.set_grad_enabled(grad_enabled):
                    original(*args, **kwargs)
            except BaseException as exc:   # re-raised on the calling thread
                outcome["error"] = exc
        thread = threading.Thread(target=run, name="autograd-device-thread", daemon=True)
        thread.start()
        thread.join(deadline)
        if thread.is_alive():
            raise BackwardHung(f"the backward did not finish within {deadline} s: something on "
                               "the backward's thread waits for the thread that called it")
        if "error" in outcome:
            raise outcome["error"]

    torch.autograd.backward = backward
    try:
        yield idents
    finally:
        torch.autograd.backward = original
