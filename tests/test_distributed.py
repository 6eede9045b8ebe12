"""Data parallel ZenFlow with 2 and 3 processes on gloo (127.0.0.1), spawned by the tests: the
bare optimizer under DDP. The engine (checkpoints, torchrun) is in test_dist_engine.py."""
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_mlp
from dist_helpers import rank_main, single_process_run

import zenflow

pytestmark = pytest.mark.slow
STEPS = 20
ROWS = [24, 24, 5]   # rows of the MLP's matrices
COLS = [12, 24, 24]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, args: tuple, tmp_path, world: int, timeout: float) -> list:
    """Run target(rank, world, port, *args) on `world` processes; each writes rank<r>.pt under
    tmp_path. Fails as a hang when a rank is still running after `timeout` seconds."""
    ctx = mp.spawn(target, args=(world, free_port(), *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"ranks still running after {timeout}s: a hang"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
            if (tmp_path / f"rank{r}.pt").exists() else None for r in range(world)]


def run_ranks(tmp_path, mode, overlap=False, steps=STEPS, worker=False, timeout=120, world=2,
              options=None):
    return spawn_ranks(rank_main, (mode, overlap, str(tmp_path), steps, worker, options),
                       tmp_path, world, timeout)


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


@pytest.mark.parametrize("world,overlap", [(2, False), (2, True), (3, False), (3, True)])
def test_ddp_matches_single_process_and_partitions_host_state(tmp_path, world, overlap):
    ranks = run_ranks(tmp_path, "ddp", overlap=overlap, worker=overlap, world=world)
    assert_ok(ranks)
    for r in ranks[1:]:
        assert_same(ranks[0]["weights"], r["weights"], exact=True)
    single = single_process_run(STEPS, overlap)
    assert_same(ranks[0]["weights"], single["weights"], exact=False)
    assert single["reselections"] > 0 and all(r["reselections"] == single["reselections"]
                                              for r in ranks)
    # Each rank's host holds only its rows, and copies only those rows to the host.
    assert [r["host_rows"] for r in ranks] == [rows_of(k, world) for k in range(world)]
    # (each rank's staging slot also holds its step's 4-byte factor: one per rank, on a CPU)
    assert sum(r["host_bytes"] for r in ranks) == single["host_bytes"] + 4 * (world - 1)
    assert sum(r["d2h_bytes"] for r in ranks) == single["d2h_bytes"]
    total = sum(n * c for n, c in zip(ROWS, COLS))
    for k, r in enumerate(ranks):
        own = sum(n * c for n, c in zip(rows_of(k, world), COLS))
        assert r["d2h_bytes"] * total == single["d2h_bytes"] * own   # exactly its rows' share
        # what crossed the network: column norms, installs; never a gradient on the host side
        assert set(r["collective_bytes_sent"]) >= {"exchanging column norms",
                                                   "installing host-updated rows"}


def test_host_paced_windows_end_on_every_rank_at_once(tmp_path):
    """The default windows follow each rank's own host; the ranks still end every window at the
    same step and keep identical weights."""
    ranks = run_ranks(tmp_path, "ddp_defaults")
    assert_ok(ranks)
    flushes = [[s for s, kind in r["decisions"] if kind == "flush"] for r in ranks]
    assert len(flushes[0]) >= 2 and flushes[0] == flushes[1]
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert_same(ranks[0]["weights"], ranks[1]["weights"], exact=True)


def test_the_bare_optimizer_refuses_to_train_alone_when_launched_with_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but torch.distributed is not "
                                           "initialized, so this rank would train alone"):
        zenflow.ZenFlowAdamW(make_mlp().parameters(), worker=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    zenflow.ZenFlowAdamW(make_mlp().parameters(), worker=False).close()


def test_a_rank_that_dies_fails_the_others_without_a_hang(tmp_path):
    start = time.monotonic()
    ranks = run_ranks(tmp_path, "rank_dies", timeout=120)
    assert time.monotonic() - start < 120
    assert ranks[1] is None  # it died without writing anything
    assert "another rank may have died" in ranks[0]["error"], ranks[0]["error"]
