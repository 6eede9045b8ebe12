"""Spawning gloo ranks on 127.0.0.1 from a test, and checking what they wrote (the parent's side;
the ranks run tests/helpers/dist_ranks.py, fsdp_ranks.py or fsdp_frameworks.py)."""
import socket
import time

import torch
import torch.multiprocessing as mp

from helpers.dist_ranks import rank_main
from helpers.rank_pool import pool

STEPS = 20
# rank_main modes whose test needs a rank's process to end with its target (a pool process
# would live on)
ENDS_ITS_PROCESS = {"save_after_a_rank_exits", "checkpoint_calls"}
ROWS = [24, 24, 5]   # rows of the MLP's matrices
COLS = [12, 24, 24]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, args: tuple, tmp_path, world: int, timeout: float,
                fresh: bool = False) -> list:
    """Run target(rank, world, port, *args) on `world` processes; each writes rank<r>.pt under
    tmp_path. Fails as a hang when a rank is still running after `timeout` seconds. The
    processes are the session's rank pool (helpers/rank_pool.py), or with `fresh` new ones, for
    a test that needs a rank's process to end when its target returns."""
    if fresh:
        ctx = mp.spawn(target, args=(world, free_port(), *args), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        problems = [f"ranks still running after {timeout}s: a hang"] if alive else []
    else:
        problems = pool().run(target, (world, free_port(), *args), world, timeout)
    assert not problems, problems
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
            if (tmp_path / f"rank{r}.pt").exists() else None for r in range(world)]


def run_ranks(tmp_path, mode, overlap=False, steps=STEPS, worker=False, timeout=120, world=2,
              options=None):
    return spawn_ranks(rank_main, (mode, overlap, str(tmp_path), steps, worker, options),
                       tmp_path, world, timeout, fresh=mode in ENDS_ITS_PROCESS)


def assert_same(a, b, exact):
    for name, value in a.items():
        if exact:
            assert torch.equal(value, b[name]), name
        else:
            torch.testing.assert_close(value, b[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def assert_ok(ranks):
    for r in ranks:
        assert r is not None and "error" not in r, r and r.get("error")


def rows_of(rank, world):
    """The rows each rank's host holds of each matrix: ceil(rows / world), the last rank less."""
    out = []
    for n in ROWS:
        per = -(-n // world)
        out.append(max(0, min(n, (rank + 1) * per) - min(n, rank * per)))
    return out
