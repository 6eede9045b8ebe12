"""zenflow.initialize on an FSDP2-sharded model (issue 25, items 3 and 4): a DeepSpeed JSON with
stage 3 and a zenflow block maps to it; the engine's checkpoints go through
torch.distributed.checkpoint, resume bit-exactly on 2 gloo ranks and load on 3."""
import pytest

from helpers.dist_ranks import single_process_run
from helpers.fsdp_ranks import STEPS, run_fsdp, single_process_fsdp_reference
from helpers.spawn import assert_ok, assert_same

# Every test here reads the ranks of one module-wide spawn (its fixture): 2 gloo ranks.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("engine")
    ranks = run_fsdp(tmp_path, "runs", world=2, runs={
        "plain": ("engine", {"overlap": False, "export": str(tmp_path / "export")}),
        "checkpointed": ("engine", {"dir": str(tmp_path / "ckpt")}),
        "refused": ("engine_refused", {})})
    assert_ok(ranks)
    for r in ranks:
        for run in r.values():
            assert "error" not in run, run.get("error")
    return ranks, tmp_path / "ckpt"


def test_a_stage_3_config_trains_an_fsdp2_model_like_one_process(two_ranks):
    ranks, _ = two_ranks
    single = single_process_fsdp_reference(STEPS, overlap=False)
    for r in (rank["plain"] for rank in ranks):
        assert r["optimizer"] == "ZenFlowAdamW" and r["not_averaged"]
        assert r["selections"] == single["selections"]
        assert_same(r["weights"], single["weights"], exact=False)
    assert_same(ranks[0]["plain"]["weights"], ranks[1]["plain"]["weights"], exact=True)
    # save_16bit_model writes whole weights (fp32 here: no bf16 block), gathered from the shards
    assert_same(ranks[0]["plain"]["exported"], ranks[0]["plain"]["weights"], exact=True)
    assert set(ranks[0]["plain"]["exported"]) == set(ranks[0]["plain"]["weights"])


def test_the_engine_checkpoint_of_an_fsdp2_model_resumes_bit_exactly(two_ranks):
    ranks, path = two_ranks
    single = single_process_fsdp_reference(STEPS, overlap=True)
    synchronized = single_process_run(STEPS, True, synchronized=True)["weights"]
    for r in (rank["checkpointed"] for rank in ranks):
        assert r["loaded_steps"] == STEPS // 2
        assert_same(r["resumed"], r["weights"], exact=True)
        # and saving changed nothing in the run that saved (whose weights were read after
        # engine.synchronize())
        assert r["selections"] == single["selections"]
        assert_same(r["weights"], synchronized, exact=False)
    files = sorted(p.name for p in (path / "half" / "distributed_checkpoint").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_what_does_not_map_to_fsdp2_is_refused_by_name(two_ranks):
    ranks, _ = two_ranks
    refused = ranks[0]["refused"]
    assert refused["untouched"]
    assert "bf16.enabled is true, but the model is FSDP2-sharded" in refused["errors"]["bf16"]
    assert "MixedPrecisionPolicy" in refused["errors"]["bf16"]
    assert "zero_optimization.stage is 3" in refused["errors"]["stage3_unsharded"]
    assert "fully_shard" in refused["errors"]["stage3_unsharded"]


@pytest.mark.slow
def test_the_engine_checkpoint_of_two_ranks_loads_on_three(two_ranks, tmp_path):
    ranks, path = two_ranks
    three = run_fsdp(tmp_path, "runs", world=3,
                     runs={"r": ("engine_reshard", {"dir": str(path)})})
    assert_ok(three)
    single = single_process_fsdp_reference(STEPS, overlap=True)
    synchronized = single_process_run(STEPS, True, synchronized=True)["weights"]
    for r in (rank["r"] for rank in three):
        assert "error" not in r, r.get("error")
        assert r["loaded_steps"] == STEPS // 2 and r["module_only_steps"] == 0
        assert r["selections"] == single["selections"]
        assert_same(r["resumed"], three[0]["r"]["resumed"], exact=True)
        assert_same(r["resumed"], ranks[0]["checkpointed"]["weights"], exact=False)
        assert_same(r["resumed"], synchronized, exact=False)
        assert_same(r["module_only"], three[0]["r"]["module_only"], exact=True)
