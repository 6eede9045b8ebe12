"""deferred_credit="factored" on FSDP2 (2 gloo ranks, one spawn for every case): each rank fits
the factors of its own row shard as if the shard were the whole matrix (docs/semantics.md), so
the ranks equal one process whose factors are fitted per row block, FSDP2's blocks; that one
process is zenflow.optim.reference with `row_blocks`. A rank's own saved state, and a DCP
checkpoint on as many ranks, resume bit-exactly; one-step windows without overlap are AdamW."""
import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

from helpers.ddp_factored_ranks import per_block_reference
from helpers.dist_ranks import adamw_on_the_whole_batch
from helpers.fsdp_ranks import STEPS, run_fsdp
from helpers.models import make_mlp, mlp_loss
from helpers.spawn import assert_ok, assert_same, rows_of

WORLD = 2
# Every window sum on the (CPU) device, with room for the factors: every matrix moves.
FACTORED = {"deferred_credit": "factored", "device_sum_budget": 1 << 40}
ADAMW_LIKE = {**FACTORED, "topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each case's result on each rank (helpers/fsdp_ranks.py's modes)."""
    tmp_path = tmp_path_factory.mktemp("fsdp2_factored")
    ckpt = str(tmp_path / "ckpt")
    runs = {"factored": ("fsdp", {"overlap": True, "worker": True, "settings": FACTORED}),
            "adamw": ("fsdp", {"settings": ADAMW_LIKE}),
            "resume": ("resume", {"settings": FACTORED}),
            "dcp": ("dcp_resume", {"dir": ckpt, "settings": FACTORED}),
            "dcp_stepped": ("dcp_factors", {"dir": ckpt, "stepped": True, "settings": FACTORED}),
            "dcp_fresh": ("dcp_factors", {"dir": ckpt, "settings": FACTORED})}
    out = run_fsdp(tmp_path, "runs", world=WORLD, runs=runs, timeout=300)
    assert_ok(out)
    return out, ckpt


@pytest.mark.slow
def test_each_rank_fits_its_own_shard_as_the_per_block_reference(ranks):
    out, _ = ranks
    runs = [r["factored"] for r in out]
    weights, chosen = per_block_reference(STEPS, WORLD)   # FSDP2's shards are DDP's row blocks
    for r in runs:
        assert r["moments_matrices"] == 3   # every matrix under "factored"
        assert r["selections"] == runs[0]["selections"] == chosen
        assert r["windows"] == runs[0]["windows"] and r["reselections"] > 0
        assert_same(r["weights"], runs[0]["weights"], exact=True)
    # The gradients come from FSDP2's reduce-scatter: equal up to the order of that sum.
    assert_same(runs[0]["weights"], weights, exact=False)


@pytest.mark.slow
def test_one_step_windows_without_overlap_are_adamw(ranks):
    out, _ = ranks
    adamw = adamw_on_the_whole_batch(STEPS)
    for r in out:
        assert r["adamw"]["moments_matrices"] == 3
        assert_same(r["adamw"]["weights"], adamw, exact=False)


@pytest.mark.slow
def test_a_ranks_own_state_saved_mid_window_resumes_bit_exactly(ranks):
    out, _ = ranks
    for k, r in enumerate(out):
        resume = r["resume"]
        # saved inside a window: 2 of its 3 steps summed, with their row and column statistics
        assert resume["saved_window_steps"] == 2
        # the first matrix's factors of this rank's rows: its row block, all 12 columns
        assert resume["saved_factors"] == {"row_factors": (3, rows_of(k, WORLD)[0]),
                                           "col_factors": (3, 12)}
        assert_same(resume["resumed"], resume["straight"], exact=True)
        assert_same(resume["straight"], r["factored"]["weights"], exact=True)


@pytest.mark.slow
def test_a_dcp_checkpoint_keeps_each_ranks_factors(ranks):
    """Through DCP each rank's factors are DTensors: its rows of the row factors, its block of
    the column factors (a plain tensor would be kept from one rank only)."""
    out, ckpt = ranks
    saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    for key, shape in (("optim.state.0.weight.host.row_factors", (3, 24)),
                       ("optim.state.0.weight.host.col_factors", (3 * WORLD, 12)),
                       ("optim.state.4.weight.host.row_factors", (3, 5))):
        assert tuple(saved[key].size) == shape and len(saved[key].chunks) == WORLD, key
    for r in out:
        straight = r["dcp"]["straight"]
        assert_same(r["dcp"]["continued"], straight, exact=True)   # saving changed nothing
        # A template that asks for the factors gets this rank's back: an optimizer's that has
        # stepped, or a fresh one's completed from the checkpoint (as the engine's load does).
        for run in ("dcp_stepped", "dcp_fresh"):
            assert r[run]["loaded_step"] == STEPS // 2
            assert_same(r[run]["resumed"], straight, exact=True)
        # full_state_dict=True: whole tensors in memory; each rank takes its rows and block.
        assert_same(r["dcp"]["resumed_whole"], straight, exact=True)
        # torch's recipe on a fresh optimizer: its template holds no factors, so DCP reads none
        # and the matrices start as a state saved under another rule does (not bit-exact).
        assert r["dcp"]["loaded_step"] == STEPS // 2
        assert r["dcp"]["selections_loaded"] == r["dcp"]["selections_saved"]


def test_the_reference_fits_each_row_block_as_a_matrix_of_its_own():
    """With no device columns (topk_ratio 0) nothing couples a matrix's rows but the factors:
    the reference's row blocks are then the same as separate matrices, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    whole = torch.randn(7, 5, generator=gen)
    kw = dict(lr=1e-2, topk_ratio=0.0, update_interval=3, overlap_step=True,
              deferred_credit="factored")
    blocked = ReferenceZenFlow([whole], row_blocks={0: [3, 4]}, **kw)
    parts = [whole[:3].clone(), whole[3:].clone()]
    separate = ReferenceZenFlow(parts, **kw)
    one_block = ReferenceZenFlow([whole.clone()], **kw)
    for t in range(10):
        grad = torch.randn(7, 5, generator=gen) * torch.linspace(0.1, 3.0, 7)[:, None]
        blocked.step([grad])
        separate.step([grad[:3], grad[3:]])
        one_block.step([grad])
        assert torch.equal(whole, torch.cat(parts)), f"step {t}"
    assert not torch.equal(whole, one_block.params[0])   # one block is another fit
    with pytest.raises(ValueError, match="do not split 7 rows"):
        ReferenceZenFlow([whole], row_blocks={0: [3, 3]}, **kw)


def test_column_factors_of_another_split_of_the_rows_are_not_taken():
    """A full state dict of FSDP2 ranks holds one block of column factors per rank ([3 * ranks,
    cols]); loaded where the rows are split otherwise (here one process), they fit no shard: the
    matrix starts as a state saved without factors does (as under another rule)."""
    def trained(state=None, steps=8, start=0):
        model = make_mlp()
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                                   update_interval=3, worker=False, **FACTORED)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        for t in range(start, start + steps):
            mlp_loss(model, t).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = trained()
    saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": opt.state_dict()}
    opt.close()

    def with_hosts(change):
        state = copy.deepcopy(saved)
        for piece in state["optimizer"]["state"].values():
            if "host" in piece:
                piece["host"] = change(piece["host"])
        return state
    two_blocks = with_hosts(lambda h: {**h, "col_factors": torch.cat([h["col_factors"]] * 2)})
    without = with_hosts(lambda h: {k: v for k, v in h.items() if not k.endswith("_factors")})
    weights = {}
    for name, state in (("kept", saved), ("two_blocks", two_blocks), ("without", without)):
        model, opt = trained(state, steps=7, start=8)
        weights[name] = copy.deepcopy(model.state_dict())
        opt.close()
    assert_same(weights["two_blocks"], weights["without"], exact=True)
    assert not all(torch.equal(weights["kept"][k], v) for k, v in weights["without"].items())
