"""Data parallel ZenFlow with 2 processes on gloo (127.0.0.1), spawned by the tests."""
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

import zenflow
from dist_helpers import rank_main, single_process_run

pytestmark = pytest.mark.slow
STEPS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, mode, overlap=False, steps=STEPS, worker=False, timeout=240):
    ctx = mp.spawn(rank_main, args=(2, free_port(), mode, overlap, str(tmp_path), steps, worker),
                   nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"ranks still running after {timeout}s: a hang"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
            if (tmp_path / f"rank{r}.pt").exists() else None for r in range(2)]


def assert_same(a, b, exact):
    for name, value in a.items():
        if exact:
            assert torch.equal(value, b[name]), name
        else:
            torch.testing.assert_close(value, b[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_matches_single_process_and_partitions_host_state(tmp_path, overlap):
    ranks = run_ranks(tmp_path, "ddp", overlap=overlap, worker=overlap)
    for r in ranks:
        assert "error" not in r, r.get("error")
    assert_same(ranks[0]["weights"], ranks[1]["weights"], exact=True)
    single = single_process_run(STEPS, overlap)
    assert_same(ranks[0]["weights"], single["weights"], exact=False)
    # MLP matrices have 24, 24 and 5 rows: each rank holds ceil(rows / 2) of them
    assert ranks[0]["host_rows"] == [12, 12, 3] and ranks[1]["host_rows"] == [12, 12, 2]
    assert ranks[0]["host_bytes"] + ranks[1]["host_bytes"] == single["host_bytes"]


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_averages_gradients_and_resumes_on_two_ranks(tmp_path, overlap):
    straight = run_ranks(tmp_path, "engine", overlap=overlap)
    resumed = run_ranks(tmp_path, "engine_resume", overlap=overlap)
    for r in straight + resumed:
        assert "error" not in r, r.get("error")
    assert_same(straight[0]["weights"], straight[1]["weights"], exact=True)
    assert_same(straight[0]["weights"], single_process_run(STEPS, overlap)["weights"],
                exact=False)
    assert_same(straight[0]["weights"], resumed[0]["weights"], exact=True)
    assert_same(resumed[0]["weights"], resumed[1]["weights"], exact=True)
    # a 2-rank checkpoint does not load into a single process
    engine, *_ = zenflow.initialize(model=torch.nn.Linear(12, 5),
                                    config={"train_batch_size": 8,
                                            "optimizer": {"type": "AdamW"}})
    with pytest.raises(ValueError, match="written by 2 rank"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_a_rank_that_dies_fails_the_others_without_a_hang(tmp_path):
    start = time.monotonic()
    ranks = run_ranks(tmp_path, "rank_dies", timeout=120)
    assert time.monotonic() - start < 120
    assert ranks[1] is None  # it died without writing anything
    assert "another rank may have died" in ranks[0]["error"], ranks[0]["error"]
