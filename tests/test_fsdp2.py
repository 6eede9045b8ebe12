"""ZenFlow on FSDP2 (issue 25): parameters sharded by fully_shard (DTensors, Shard(0)) on 2 and 3
gloo ranks, spawned by the tests. Each rank keeps the state of its own rows; the ranks exchange
column norms and squared gradient norms only."""
import math
import subprocess
import sys

import pytest
import torch

from helpers.children import program, with_root_on_path
from helpers.fsdp_ranks import STEPS, run_fsdp, single_process_fsdp_reference
from helpers.spawn import COLS, ROWS, assert_ok, assert_same, rows_of


def check_matches_single_process(ranks, world, overlap, moments=False):
    """Weights after STEPS steps equal one process on the whole batch; the ranks chose the same
    columns as it; each rank holds and moves only its own rows."""
    single = single_process_fsdp_reference(STEPS, overlap, moments)
    # Every rank chose the same columns, and the single process chose them too (the MLP's
    # column norms have no near-ties at this seed; a near-tie could legitimately differ).
    for r in ranks:
        assert r["selections"] == ranks[0]["selections"]
        assert r["reselections"] == single["reselections"] > 0
        assert r["windows"] == single["windows"]
        assert_same(r["weights"], ranks[0]["weights"], exact=True)
    assert ranks[0]["selections"] == single["selections"]
    assert_same(ranks[0]["weights"], single["weights"], exact=False)
    # FSDP2's row blocks: ceil(rows / N), the last rank fewer (5 rows are uneven on 2 and 3).
    assert [r["host_rows"] for r in ranks] == [rows_of(k, world) for k in range(world)]
    # (each rank's staging slot also holds its step's 4-byte factor: one per rank, on a CPU)
    assert sum(r["host_bytes"] for r in ranks) == single["host_bytes"] + 4 * (world - 1)
    assert sum(r["d2h_bytes"] for r in ranks) == single["d2h_bytes"]
    # Installs write only the rank's rows: no rank copies a whole matrix (DDP on gloo does).
    assert sum(r["h2d_bytes"] for r in ranks) == single["h2d_bytes"]
    for k, r in enumerate(ranks):
        share = sum(n * c for n, c in zip(rows_of(k, world), COLS)) / sum(
            n * c for n, c in zip(ROWS, COLS))
        assert r["d2h_bytes"] == pytest.approx(single["d2h_bytes"] * share)
        assert r["h2d_bytes"] == pytest.approx(single["h2d_bytes"] * share)
        # Nothing but norms crossed the network: no gradient, no weight, no gather.
        assert set(r["collective_bytes_sent"]) == {"exchanging column norms",
                                                   "summing the squared gradient norms"}


@pytest.mark.slow   # spawns 2 ranks
def test_fsdp2_on_two_ranks(tmp_path):
    """One set of 2 ranks: ZenFlowAdamW with and without overlap, OffloadAdamW, bf16 mixed
    precision, the refusals, and a bit-exact resume from each rank's saved shards."""
    runs = {"sync": ("fsdp", {}), "overlap": ("fsdp", {"overlap": True, "worker": True}),
            "moments": ("fsdp", {"overlap": True, "moments": True}),
            "offload": ("fsdp", {"offload": True}),
            "mixed": ("fsdp", {"mixed_precision": True}), "refused": ("refused", {}),
            "resume": ("resume", {})}
    ranks = run_fsdp(tmp_path, "runs", world=2, runs=runs)
    assert_ok(ranks)
    for name in ("sync", "overlap"):
        check_matches_single_process([r[name] for r in ranks], 2, overlap=name == "overlap")
    # deferred_credit "moments" on row shards: each rank steps and corrects its own rows
    check_matches_single_process([r["moments"] for r in ranks], 2, overlap=True, moments=True)
    assert all(r["moments"]["moments_matrices"] == 3 for r in ranks)

    offload = [r["offload"] for r in ranks]
    assert_same(offload[0]["weights"], offload[1]["weights"], exact=True)
    assert [r["host_rows"] for r in offload] == [[12, 12, 12, 12, 3, 3], [12, 12, 12, 12, 2, 2]]

    mixed = [r["mixed"] for r in ranks]
    assert mixed[0]["selections"] == mixed[1]["selections"] and mixed[0]["skipped"] == 0
    assert_same(mixed[0]["weights"], mixed[1]["weights"], exact=True)
    single = single_process_fsdp_reference(STEPS, False)
    for name, w in mixed[0]["weights"].items():
        assert w.dtype == torch.float32   # the sharded parameters stay fp32
        # bf16 compute with fp32 state: near the fp32 run, not equal to it
        torch.testing.assert_close(w, single["weights"][name], rtol=0, atol=3e-2)

    for r in ranks:
        assert_same(r["resume"]["resumed"], r["resume"]["straight"], exact=True)

    errors = ranks[0]["refused"]["errors"]
    assert "Replicate()" in errors["replicate"] and "Shard(dim=0)" in errors["replicate"]
    assert "Shard(dim=1)" in errors["shard1"]
    assert "mixes DTensors" in errors["mixed"] and "params[6]" in errors["mixed"]


@pytest.mark.slow
def test_fsdp2_on_three_ranks(tmp_path):
    runs = {"sync": ("fsdp", {}), "overlap": ("fsdp", {"overlap": True, "worker": True})}
    ranks = run_fsdp(tmp_path, "runs", world=3, runs=runs)
    assert_ok(ranks)
    for name in ("sync", "overlap"):
        check_matches_single_process([r[name] for r in ranks], 3, overlap=name == "overlap")


@pytest.mark.slow
def test_a_llama_shaped_model_trains_sharded_under_torchrun(tmp_path):
    """A script without a __main__ guard, under torchrun, 2 gloo ranks: 226 matrices."""
    script = program("fsdp_llama_script.py")
    env = with_root_on_path(OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(script), str(tmp_path)],
                   check=True, env=env, timeout=300, capture_output=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for r in results:
        assert r["matrices"] == 226 and r["worker"] and r["windows"] >= 2
        assert all(math.isfinite(loss) for loss in r["losses"])
    assert results[0]["selections"] == results[1]["selections"]
