"""The engine under data parallel with 2 gloo processes: gradient averaging, per-rank checkpoint
shares and an exact resume, load_module_only across world sizes, and a torchrun-style launch
that never calls init_process_group."""
import pytest
import torch

import zenflow

from helpers.dist_ranks import engine_config, single_process_run
from helpers.models import make_mlp
from helpers.spawn import STEPS, assert_ok, assert_same, rows_of, run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_averages_gradients_and_resumes_on_two_ranks(tmp_path, overlap):
    ranks = run_ranks(tmp_path, "engine_resume", overlap=overlap)
    assert_ok(ranks)
    straight = [r["straight"] for r in ranks]
    assert_same(straight[0], straight[1], exact=True)
    # the engine's state_dict() installs the update in flight on every rank, as in one process
    assert_same(straight[0], single_process_run(STEPS, overlap, synchronized=True)["weights"],
                exact=False)
    assert_same(straight[0], ranks[0]["weights"], exact=True)   # the resume is exact
    assert_same(ranks[0]["weights"], ranks[1]["weights"], exact=True)
    # each rank wrote its own share, holding its rows; nothing was left next to the checkpoint
    ckpt = tmp_path / "ckpt"
    tag = (ckpt / "latest").read_text()
    assert sorted(p.name for p in (ckpt / tag).iterdir()) == [
        "engine_states.pt", "manifest.json", "model_states.pt", "rank0_states.pt",
        "rank1_states.pt"]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(f".{tag}.")]
    for r in range(2):
        share = torch.load(ckpt / tag / f"rank{r}_states.pt", weights_only=True)
        host = [s["host"]["master"].shape[0] for s in share["optimizer"]["state"].values()
                if s["kind"] == "host"]
        assert host == rows_of(r, 2)
    # a 2-rank checkpoint does not resume a single process...
    engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap, world=1))
    with pytest.raises(ValueError, match="written by 2 rank"):
        engine.load_checkpoint(ckpt)
    # ...but its weights load on any world size
    engine.load_checkpoint(ckpt, load_module_only=True)
    saved = torch.load(ckpt / tag / "model_states.pt", weights_only=True)
    assert_same(saved, {k: v.detach() for k, v in engine.module.state_dict().items()},
                exact=True)
    engine.close()


def test_torchrun_without_init_process_group_trains_in_sync(tmp_path):
    ranks = run_ranks(tmp_path, "torchrun", overlap=True)
    assert_ok(ranks)
    assert [r["backend"] for r in ranks] == ["gloo", "gloo"]
    assert_same(ranks[0]["weights"], ranks[1]["weights"], exact=True)
    assert_same(ranks[0]["weights"], single_process_run(STEPS, True, synchronized=True)["weights"],
                exact=False)
