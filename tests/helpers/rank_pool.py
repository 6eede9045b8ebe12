"""Rank processes kept for the whole test session: a test's gloo ranks run in processes that
have imported torch, zenflow and the helpers once, instead of in fresh ones (about 2 s of CPU
each on this machine's 2 cores, 3-5 s of every multi-process test).

Each job starts as a fresh process would: the environment as the process began, torch's
default seed, no process group, warnings not yet shown. A process whose job failed (raised, or
left its process group: the targets end theirs when they succeed), hung or died is replaced, so
no job sees what a broken one left; tests of processes that die on purpose still get their None
result for the dead rank (spawn.py reads the files ranks write).
"""
import atexit
import gc
import multiprocessing
import os
import sys
import time
import traceback
import warnings

FRESH_SEED = 67280421310721   # torch.initial_seed() of a process that never seeded


def _serve(conn) -> None:
    """A pool process: run (target, rank, args) jobs until told to stop or the test process
    goes away (recv() raises EOFError)."""
    import torch
    import torch.distributed as dist
    environ = dict(os.environ)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        target, rank, args = job
        os.environ.clear()
        os.environ.update(environ)
        torch.manual_seed(FRESH_SEED)
        warnings.resetwarnings()
        for module in list(sys.modules.values()):   # warnings.warn's "once per place" registry
            registry = getattr(module, "__warningregistry__", None)
            if isinstance(registry, dict):
                registry.clear()
        ok = True
        try:
            target(rank, *args)
        except BaseException:   # noqa: BLE001 - reported through the missing result, and here
            traceback.print_exc()
            ok = False
        if dist.is_available() and dist.is_initialized():
            # The targets end their group when they succeed: one left means the job failed,
            # and what it left running (an engine never closed) may wait on that group.
            ok = False
        gc.collect()   # optimizers a job dropped without close() release their workers now
        try:
            conn.send(ok)
        except (BrokenPipeError, OSError):
            return


class _Rank:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=False)
        self.process.start()
        child.close()

    def stop(self, wait: float) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(wait)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RankPool:
    """Processes for ranks 0, 1, ... (started when first needed, replaced when broken)."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._ranks: list[_Rank] = []
        atexit.register(self.close)

    def run(self, target, args: tuple, world: int, timeout: float) -> list[str]:
        """target(rank, *args) on ranks 0..world-1 at once; returns what went wrong (a rank
        still running after `timeout` seconds is killed: a hang)."""
        while len(self._ranks) < world:
            self._ranks.append(_Rank(self._ctx))
        ranks = self._ranks[:world]
        for rank, r in enumerate(ranks):
            r.conn.send((target, rank, args))
        deadline = time.monotonic() + timeout
        pending, failed = set(range(world)), set()
        while pending:
            for rank in sorted(pending):
                r = ranks[rank]
                if r.conn.poll():
                    try:
                        if not r.conn.recv():
                            failed.add(rank)
                    except (EOFError, OSError):   # it died mid-job
                        failed.add(rank)
                    pending.discard(rank)
                elif not r.process.is_alive():
                    failed.add(rank)
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                break
            if pending:
                time.sleep(0.02)
        problems = [f"rank {rank} still running after {timeout}s: a hang" for rank in sorted(pending)]
        for rank in sorted(pending | failed):   # hung, failed or died: a fresh process next time
            ranks[rank].stop(wait=0.0)
            self._ranks[rank] = _Rank(self._ctx)
        return problems

    def close(self) -> None:
        for r in self._ranks:
            r.stop(wait=5.0)
        self._ranks = []


_POOL: RankPool | None = None


def pool() -> RankPool:
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
    return _POOL
