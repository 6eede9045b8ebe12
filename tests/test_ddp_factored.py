"""deferred_credit="factored" on DDP (2 gloo ranks, one spawn for every case): each rank fits the
factors of its own row block of the replicas and the ranks gather them (docs/semantics.md), so
the replicas stay bit-identical and equal one process whose factors are fitted per row block,
DDP's blocks: zenflow.optim.reference with `row_blocks`. The MLP's 5-row matrix splits 3 + 2, so
the last rank's block is the shorter one. A rank's own saved state resumes bit-exactly mid-window;
one-step windows without overlap are AdamW."""
import pytest
import torch

from zenflow.distributed import Partition
from zenflow.host.credit import (
    Credit,
    FactoredCredit,
    MomentsCredit,
    ReplicaFactoredCredit,
    credit_for,
    on_replicas,
)
from zenflow.host.credit_factored import factor_bytes
from zenflow.host.credit_replicas import replica_factor_bytes

from helpers.ddp_factored_ranks import (
    ADAMW_LIKE,
    FACTORED,
    STEPS,
    per_block_reference,
    run_ddp_factored,
)
from helpers.dist_ranks import adamw_on_the_whole_batch
from helpers.spawn import assert_ok, assert_same, rows_of

WORLD = 2
FACTORS = "installing deferred_credit='factored' factors"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each case's result on each rank (helpers/ddp_factored_ranks.py's modes)."""
    runs = {"factored": ("ddp", {"worker": True, "settings": FACTORED}),
            "fused": ("ddp", {"worker": True, "settings": FACTORED, "fused": 2}),
            "host_gather": ("ddp", {"worker": True, "settings": FACTORED, "host_gather": True}),
            "attached": ("ddp", {"worker": True, "settings": FACTORED, "attach": True}),
            "adamw": ("ddp", {"overlap": False, "settings": ADAMW_LIKE}),
            "resume": ("resume", {"worker": True, "settings": FACTORED})}
    out = run_ddp_factored(tmp_path_factory.mktemp("ddp_factored"), runs, world=WORLD)
    assert_ok(out)
    return out


@pytest.mark.slow
def test_the_replicas_equal_the_reference_fitted_per_ddp_row_block(ranks):
    runs = [r["factored"] for r in ranks]
    weights, chosen = per_block_reference(STEPS, WORLD)
    for r in runs:
        assert r["moments_matrices"] == 3   # every matrix under "factored"
        assert r["selections"] == runs[0]["selections"] == chosen
        assert r["windows"] == runs[0]["windows"] and r["reselections"] > 0
        assert_same(r["weights"], runs[0]["weights"], exact=True)
        # one all-gather of the factors per install, far smaller than the rows installed
        sent = r["collective_bytes_sent"]
        assert 0 < sent[FACTORS] < sent["installing host-updated rows"] / 4
    # The gradients come from DDP's all-reduce: equal up to the order of that sum.
    assert_same(runs[0]["weights"], weights, exact=False)
    # Fitted per block is another fit than one process's "factored" (one block a matrix).
    one_block, _ = per_block_reference(STEPS, 1)
    assert not all(torch.allclose(v, one_block[k], rtol=1e-5, atol=1e-6)
                   for k, v in runs[0]["weights"].items())


@pytest.mark.slow
def test_each_installs_correction_and_all_gather_follow_its_copy_in_its_ticket(ranks):
    """On the device's path (NCCL; gloo on a CPU) each matrix's rows are corrected and gathered
    after its copy, in the copy's ticket (on a GPU: on the copy stream, so that an attached
    layer waits only for its own, as it does here); gloo with a GPU gathers in host memory first.
    All give the same bits."""
    for r in ranks:
        device, host = r["factored"], r["host_gather"]
        rows = "installing host-updated rows"
        assert device["sent_after_copies"][rows] == device["collective_bytes_sent"][rows] > 0
        assert host["sent_after_copies"] == {} and host["collective_bytes_sent"][rows] > 0
        assert host["selections"] == device["selections"]
        assert_same(host["weights"], device["weights"], exact=True)
        # attached: each layer's forward finishes its own matrices' installs, the same bits
        attached = r["attached"]
        assert attached["finished_in_forward"] > 0 and not attached["missed_reads"]
        assert attached["selections"] == device["selections"]
        assert_same(attached["weights"], device["weights"], exact=True)


@pytest.mark.slow
def test_the_fused_replica_step_gives_the_op_by_op_steps_bits(ranks):
    """On a GPU each step of a matrix is one kernel (factored_kernels.replica_step_; the MLP's
    three in a run of two, replica_steps_, and one alone), run here eagerly: the same weights
    as the op-by-op path's, bit for bit, on every rank, with no op-by-op step left."""
    for r in ranks:
        fused, plain = r["fused"], r["factored"]
        assert plain["fused_steps"] == 0
        assert fused["fused_steps"] == 3 * STEPS   # every matrix, every step
        assert fused["selections"] == plain["selections"]
        assert_same(fused["weights"], plain["weights"], exact=True)


@pytest.mark.slow
def test_one_step_windows_without_overlap_are_adamw(ranks):
    adamw = adamw_on_the_whole_batch(STEPS)
    for r in ranks:
        assert r["adamw"]["moments_matrices"] == 3
        assert_same(r["adamw"]["weights"], ranks[0]["adamw"]["weights"], exact=True)
        assert_same(r["adamw"]["weights"], adamw, exact=False)


@pytest.mark.slow
def test_a_ranks_own_state_saved_mid_window_resumes_bit_exactly(ranks):
    for k, r in enumerate(ranks):
        resume = r["resume"]
        # saved inside a window: 2 of its 3 steps summed, with their row and column statistics
        assert resume["saved_window_steps"] == 2
        # the first matrix's factors of this rank's rows: its row block, all 12 columns
        assert resume["saved_factors"] == {"row_factors": (3, rows_of(k, WORLD)[0]),
                                           "col_factors": (3, 12)}
        assert_same(resume["resumed"], resume["straight"], exact=True)
        assert_same(resume["straight"], r["factored"]["weights"], exact=True)
        # the loaded factors were gathered from every rank before the first step used them
        assert "gathering loaded deferred_credit='factored' factors" in resume["purposes"]


def test_ddp_takes_factored_and_moments_takes_mean():
    """"factored" fits each rank's row block, so DDP keeps it (the host pipeline runs it as
    ReplicaFactoredCredit); "moments"' rates are per value, so DDP takes "mean" for it."""
    ddp, fsdp2 = Partition(rank=1, world_size=2), Partition(rank=1, world_size=2,
                                                            rows_are_local=True)
    for cuda in (False, True):
        rule = credit_for("factored", 1 << 40, cuda, ddp.splits_rows)
        assert type(rule) is FactoredCredit
        assert type(on_replicas(rule, ddp, [5])) is ReplicaFactoredCredit
        assert type(on_replicas(rule, fsdp2, [5])) is FactoredCredit   # a shard is its rows
        assert type(on_replicas(rule, Partition(), [5])) is FactoredCredit
        assert type(credit_for("moments", 1 << 40, cuda, ddp.splits_rows)) is Credit
        assert type(credit_for("moments", 1 << 40, cuda, fsdp2.splits_rows)) is MomentsCredit
    with pytest.raises(ValueError, match="cannot run on DDP replicas"):
        on_replicas(MomentsCredit(), ddp, [5])
    with pytest.raises(ValueError, match="for DDP's replicas"):
        ReplicaFactoredCredit(fsdp2, [5])


def test_a_replica_holds_every_ranks_factors_beside_its_own_statistics():
    """On rank 1 of 2, a [5, 7] matrix's own rows are the last 2: its device keeps their row
    sums, alpha of all 5 rows, and beta of both ranks' blocks, and places them by those bytes."""
    rule = ReplicaFactoredCredit(Partition(rank=1, world_size=2), [5])
    assert rule.state_bytes(0, 2, 7) == replica_factor_bytes(2, 5, 7, 2) == 4 * (2 + 5 + 2 * 7
                                                                                 + 2 * 7)
    assert replica_factor_bytes(5, 5, 7, 1) == factor_bytes(5, 7)   # one rank: one process's
    assert rule.factor_shapes(0, 2, 7) == ((5,), (2, 7))
