"""Data parallel ZenFlow with 2 and 3 processes on gloo (127.0.0.1), spawned by the tests: the
bare optimizer under DDP. The engine (checkpoints, torchrun) is in test_dist_engine.py."""
import time

import pytest

import zenflow

from helpers.dist_ranks import single_process_run
from helpers.models import make_mlp
from helpers.spawn import COLS, ROWS, STEPS, assert_ok, assert_same, rows_of, run_ranks

pytestmark = pytest.mark.slow


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
