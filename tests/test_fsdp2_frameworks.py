"""ZenFlow on FSDP2 through the frameworks (issue 25, item 4): Accelerate's FSDP2 plugin,
Lightning's ModelParallelStrategy, and zenflow.initialize with a stage 0-2 config on an FSDP2
model. One set of 2 gloo ranks runs them all (tests/helpers/fsdp_frameworks.py)."""
import pytest
import torch

from helpers.dist_ranks import single_process_run
from helpers.fsdp_frameworks import frameworks_rank_main
from helpers.fsdp_ranks import STEPS, single_process_fsdp_reference
from helpers.spawn import assert_ok, assert_same, spawn_ranks

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

# Every test here reads the ranks of one module-wide spawn (its fixture): 2 gloo ranks.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("frameworks")
    ranks = spawn_ranks(frameworks_rank_main,
                        (str(tmp_path), STEPS, {"modes": ["engine", "accelerate", "lightning"]}),
                        tmp_path, 2, 180)
    assert_ok(ranks)
    return ranks


def test_accelerate_fsdp2_plugin_trains_and_resumes(two_ranks):
    single = single_process_fsdp_reference(STEPS, overlap=True)
    for r in (rank["accelerate"] for rank in two_ranks):
        # prepare() swapped the optimizer's parameters for the sharded model's: the same ones.
        assert r["sharded"] and r["same_params"]
        assert r["selections"] == single["selections"]
        assert_same(r["continued"], single["weights"], exact=False)   # save_state changed nothing
        assert r["loaded_step"] == STEPS // 2
        assert_same(r["resumed"], r["continued"], exact=True)
    assert_same(two_ranks[0]["accelerate"]["continued"], two_ranks[1]["accelerate"]["continued"],
                exact=True)


def test_accelerate_refuses_an_optimizer_built_before_the_model_was_sharded(two_ranks):
    r = two_ranks[0]["accelerate"]
    assert "was not built over" in r["unsharded_first"]
    assert "a DTensor" in r["unsharded_first"] and "shape (24, 12)" in r["unsharded_first"]
    assert "fsdp2_prepare_model" in r["unsharded_first"]
    assert r["untouched"]


def test_lightning_model_parallel_strategy_trains_and_resumes(two_ranks):
    single = single_process_fsdp_reference(STEPS, overlap=True)
    synchronized = single_process_run(STEPS, True, synchronized=True)["weights"]
    ranks = [rank["lightning"] for rank in two_ranks]
    for r in ranks:
        # ZenFlowLightningCallback installed the update in flight when training ended.
        assert r["callback"]["step"] == STEPS
        assert r["callback"]["selections"] == single["selections"]
        assert_same(r["callback"]["weights"], synchronized, exact=False)
        # Without it, the checkpoint at the half (DCP, an update in flight) left the run as it
        # was, and a fresh Trainer resumed from it to the same weights, bit for bit.
        assert r["is_dcp"]
        assert_same(r["saving"]["weights"], single["weights"], exact=False)
        assert r["resumed"]["step"] == STEPS
        assert_same(r["resumed"]["weights"], r["saving"]["weights"], exact=True)
        assert r["resumed"]["selections"] == r["saving"]["selections"]
        # With the callback, saving installed the update in flight (the saving run went on from
        # there, unlike the reference): the resumed run went on the same way.
        assert_same(r["callback_resumed"]["weights"], r["callback_saving"]["weights"], exact=True)
        assert r["callback_saving"]["selections"] == single["selections"]
        assert any(not torch.equal(w, r["saving"]["weights"][k])
                   for k, w in r["callback_saving"]["weights"].items())
    assert_same(ranks[0]["saving"]["weights"], ranks[1]["saving"]["weights"], exact=True)


def test_an_fsdp2_model_under_a_stage_0_or_2_config_trains_like_stage_3(two_ranks):
    single = single_process_fsdp_reference(STEPS, overlap=False)
    for r in (rank["engine"] for rank in two_ranks):
        for stage in (2, 0):
            assert r[stage]["dcp"]   # the engine's checkpoint went through DCP, as for stage 3
            assert r[stage]["selections"] == single["selections"]
            assert_same(r[stage]["weights"], single["weights"], exact=False)
        assert_same(r[0]["weights"], r[2]["weights"], exact=True)
        assert any("zero_optimization.stage is 2" in line for line in r["log"])
