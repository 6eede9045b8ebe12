"""Points that some ranks may reach without the others, agreed before anyone enters a collective.

Under data parallel, installing ZenFlow's in-flight update and saving a checkpoint are
collectives. DeepSpeed clients reach them in ways a collective cannot survive: evaluation on
rank 0 only, or `save_checkpoint` called on rank 0 only. A collective that one rank never joins
hangs. So before such a point, the ranks meet in the process group's key-value store (a few
small keys, no collective) and find out who is there:

- a rank that goes on training marks the period it leaves (in backward() and step()), so a rank
  waiting for it learns at once that it will not come;
- a read of the model (`all_read`) installs the update only when every rank reads: the first
  rank to see all arrivals decides "sync", the first to see one leave (or to wait past a short
  deadline) decides "skip", and every rank follows the one decision (compare-and-set);
- a save (`missing_from`) names the ranks that did not come;
- a rank whose process ends (its script returned or raised without calling a save that another
  rank waits in) says so at exit, so the ranks waiting for it learn within a poll, not at the
  30-minute deadline. A rank that is killed makes torchrun end the others;
- a rank waiting in a point the others have not reached (a save's meeting, or a barrier of the
  served `deepspeed.comm`: `waiting_in`) says where, so a rank that reads the model meanwhile
  (evaluation on rank 0 only, then a barrier) knows it will not come and reads at once.

Periods are counted by this object (one per optimizer step), not by the engine's step counter,
which a checkpoint load rewinds; each engine gets its own key prefix, in creation order under
the default process group, which is the same on every rank (a process that builds a new group
after destroy_process_group() counts from 0 again, as the other ranks' new processes do).
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import time
from datetime import timedelta

import torch.distributed as dist

from zenflow.compat.deepspeed import comm

POLL_S = 0.002
# The meeting points `missing_from` waits in: the engine's collective methods.
MEETINGS = ("save_checkpoint", "save_16bit_model")
_numbering: list = [None, itertools.count()]   # the default group, and its engines so far


def _engine_number() -> int:
    """This engine's number under the default process group (the group object is held, so a
    later group cannot take its id)."""
    group = dist.group.WORLD
    if _numbering[0] is not group:
        _numbering[:] = [group, itertools.count()]
    return next(_numbering[1])


class StepAgreement:
    def __init__(self, store, rank: int, world_size: int):
        self._store = dist.PrefixStore(f"zenflow/engine{_engine_number()}/", store)
        self.rank = rank
        self.world_size = world_size
        self.period = 0
        self._left: set[int] = set()      # periods this rank has marked as left
        self._events: dict[int, dict[str, int]] = {}  # period -> kind -> points reached
        self._pid = os.getpid()
        atexit.register(self._mark_exited)

    def _mark_exited(self) -> None:
        """At this process's exit: it will reach no meeting point again. (Not at the exit of a
        child forked from it, a data-loader worker say: the rank itself is still training.)"""
        if os.getpid() != self._pid:
            return
        try:
            self._store.set(f"exited/{self.rank}", "1")
        except Exception:  # the store's host is gone too: nobody is left to wait
            pass

    @classmethod
    def for_default_group(cls) -> StepAgreement | None:
        """None in a single process (nothing to agree on)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        # The default group's own store: every rank already reaches it, no port is opened.
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size())

    # --- training marks its way -----------------------------------------------------------------

    def leave_period(self) -> None:
        """This rank trains on: nobody should wait for it at a read or save of this period."""
        if self.period not in self._left:
            self._left.add(self.period)
            self._store.set(f"{self.period}/left/{self.rank}", "1")

    def next_period(self) -> None:
        """After an optimizer step. Keys two periods old are no longer read by anyone (every rank
        has since been through a step's collectives); each rank deletes the ones it wrote."""
        self.leave_period()
        old = self.period - 2
        for kind, count in self._events.pop(old, {}).items():
            for i in range(count):
                self._store.delete_key(f"{old}/{kind}{i}/{self.rank}")
                if self.rank == 0:
                    self._store.delete_key(f"{old}/{kind}{i}/decision")
        if old in self._left:
            self._left.discard(old)
            self._store.delete_key(f"{old}/left/{self.rank}")
        self.period += 1

    # --- meeting points -------------------------------------------------------------------------

    def _arrive(self, kind: str) -> str:
        counts = self._events.setdefault(self.period, {})
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        key = f"{self.period}/{kind}{index}"
        self._store.set(f"{key}/{self.rank}", "1")
        return key

    @contextlib.contextmanager
    def waiting_in(self, point: str):
        """Say, while this rank waits in `point` for the others, that it waits there: a meeting
        of this period ("<period>/<kind><i>", as `_arrive` names it) or a barrier of the served
        comm ("barrier<n>"). Every rank reaches these points in the same order, so another rank
        can tell whether the point is one it has not reached yet (`_waits_for_me`)."""
        key = f"waiting/{self.rank}/{point}"
        self._store.set(key, "1")
        try:
            yield
        finally:
            self._store.delete_key(key)

    def _waits_for_me(self, rank: int) -> bool:
        """Whether `rank` waits in a point this rank has not reached: the barrier after those
        this rank has passed, or the next meeting of some kind in this period. It cannot come to
        read before this rank gets there. (A mark of a point this rank has passed too belongs to
        a rank on its way out of it, which may still come.)"""
        reached = self._events.get(self.period, {})
        points = [f"barrier{comm.barriers_passed + 1}",
                  *(f"{self.period}/{kind}{reached.get(kind, 0)}" for kind in MEETINGS)]
        return any(self._store.check([f"waiting/{rank}/{point}"]) for point in points)

    def _absent(self, key: str) -> tuple[list[int], str]:
        """(the ranks not arrived at `key`, why one of them will not come: "left" (it trains
        on), "exited" (its process ended), "waiting" (in a point this rank has not reached), or
        "" when none has said)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        missing = [r for r in others if not self._store.check([f"{key}/{r}"])]
        signs = (("left", lambda r: self._store.check([f"{self.period}/left/{r}"])),
                 ("exited", lambda r: self._store.check([f"exited/{r}"])),
                 ("waiting", self._waits_for_me))
        for why, says in signs:
            if any(says(r) for r in missing):
                return missing, why
        return missing, ""

    def all_read(self, deadline_s: float) -> bool:
        """Whether every rank reads the model at this point (then each installs the update)."""
        key = self._arrive("read")
        decision_key = f"{key}/decision"
        deadline = time.monotonic() + deadline_s
        while not self._store.check([decision_key]):
            missing, why = self._absent(key)
            if not missing:
                self._store.compare_set(decision_key, "", "sync")
            elif why or time.monotonic() > deadline:
                self._store.compare_set(decision_key, "", "skip")
            else:
                time.sleep(POLL_S)
        return self._store.get(decision_key) == b"sync"

    def missing_from(self, kind: str, deadline: timedelta) -> tuple[list[int], str]:
        """Wait until every rank reaches this `kind` of point (one of MEETINGS). Returns ([], "")
        when all did, else (the ranks missing, why: "left" when one went on training, "exited"
        when one's process ended, "waiting" when one waits in another point, "late" when
        `deadline` passed)."""
        assert kind in MEETINGS, kind
        key = self._arrive(kind)
        end = time.monotonic() + deadline.total_seconds()
        with self.waiting_in(key):
            while True:
                missing, why = self._absent(key)
                if not missing or why:
                    return missing, why
                if time.monotonic() > end:
                    return missing, "late"
                time.sleep(POLL_S)
