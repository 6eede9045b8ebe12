"""FSDP2 checkpoints through torch.distributed.checkpoint (issue 25, item 3): the model's and
ZenFlowAdamW's sharded state, saved with get_state_dict + dcp.save on 2 gloo ranks, resumes
bit-exactly on 2 ranks and reshards onto 3 ranks and onto one process."""
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zenflow

from helpers.dist_ranks import batch
from helpers.fsdp_ranks import (
    STEPS,
    _dcp_kwargs,
    dcp_load,
    run_fsdp,
    selections,
    single_process_fsdp_reference,
)
from helpers.models import make_mlp
from helpers.spawn import assert_ok, assert_same, rows_of

# Every test here reads the ranks of one module-wide spawn (its fixture): 2 gloo ranks.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    """The 2-rank runs of helpers/fsdp_ranks.py's _dcp_resume, and the DCP checkpoint they saved at step
    STEPS // 2 (with a host update in flight: windows of 3 steps, overlapped)."""
    tmp_path = tmp_path_factory.mktemp("dcp")
    ranks = run_fsdp(tmp_path, "runs", world=2,
                     runs={"r": ("dcp_resume", {"dir": str(tmp_path / "ckpt")})})
    assert_ok(ranks)
    return [rank["r"] for rank in ranks], tmp_path / "ckpt"


def test_a_dcp_checkpoint_resumes_bit_exactly_on_two_ranks(saved_on_two_ranks):
    ranks, path = saved_on_two_ranks
    for r in ranks:
        assert "error" not in r, r.get("error")
        # DCP's template of a fresh optimizer ran no step and touched no weight or gradient.
        assert r["fresh_untouched"]
        assert r["loaded_step"] == STEPS // 2
        assert r["selections_loaded"] == r["selections_saved"]
        assert_same(r["continued"], r["straight"], exact=True)   # saving changed nothing
        assert_same(r["resumed"], r["straight"], exact=True)
        assert r["whole_shape"] == (24, 12)   # full_state_dict=True: whole tensors
        assert_same(r["resumed_whole"], r["straight"], exact=True)
    # Each rank wrote its own rows of the state: one whole tensor per state tensor, in 2 blocks;
    # the ZenFlow-wide section survived DCP (it rides in param_groups[0]).
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, shape in (("optim.state.0.weight.host.exp_avg_sq", (24, 12)),
                       ("optim.state.0.weight.device.master", (24, 3)),
                       ("optim.state.4.weight.host.master", (5, 24)),
                       ("optim.state.4.bias.exp_avg", (5,))):
        assert tuple(saved[key].size) == shape and len(saved[key].chunks) == 2, key
    assert "optim.param_groups.0.zenflow" in saved


@pytest.mark.slow
def test_a_two_rank_dcp_checkpoint_reshards_onto_three_ranks_and_one_process(
        saved_on_two_ranks, tmp_path):
    two, path = saved_on_two_ranks
    three = run_fsdp(tmp_path, "runs", world=3, runs={
        "resume": ("dcp_reshard", {"dir": str(path)}),
        "weights": ("dcp_reshard", {"dir": str(path), "weights_only": True})})
    assert_ok(three)
    single = single_process_fsdp_reference(STEPS, overlap=True)
    for k, r in enumerate(three):
        resume = r["resume"]
        assert resume["loaded_step"] == STEPS // 2
        assert resume["host_rows"] == rows_of(k, 3)      # each rank took its new rows
        assert resume["selections_loaded"] == two[0]["selections_saved"]
        assert resume["selections"] == single["selections"]
        assert_same(resume["resumed"], three[0]["resume"]["resumed"], exact=True)
        # Only the summation order of the gradients differs from 2 ranks (and from one process).
        assert_same(resume["resumed"], two[0]["straight"], exact=False)
        assert_same(resume["resumed"], single["weights"], exact=False)
        assert_same(r["weights"]["weights"], three[0]["weights"]["weights"], exact=True)

    # One process (no process group) loads it too: whole tensors from both ranks' blocks.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    model = make_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_dcp_kwargs({"worker": False})) as opt:
        dcp_load(model, opt, str(path))
        assert opt.counters.step == STEPS // 2
        assert selections(opt) == two[0]["selections_saved"]
        section = get_optimizer_state_dict(model, opt)["param_groups"][0]["zenflow"]
        assert json.loads(section)["rank"] == 0
        for t in range(STEPS // 2, STEPS):
            x, y = batch(t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert_same({k: v.detach() for k, v in model.state_dict().items()}, single["weights"],
                    exact=False)
