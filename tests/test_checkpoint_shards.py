"""write_sharded_checkpoint in one process (its collectives are identities there); the
multi-rank save and resume run in tests/test_distributed.py."""
import pytest
import torch

from zenflow.distributed import Partition
from zenflow.engine.checkpoint import CheckpointError
from zenflow.engine.checkpoint_read import read_checkpoint
from zenflow.engine.checkpoint_shards import write_sharded_checkpoint


def test_each_share_is_moved_in_and_listed_in_the_manifest(tmp_path):
    path = write_sharded_checkpoint(Partition(), tmp_path, "t1", {"common.pt": {"a": 1}},
                                    "rank0_states.pt", {"w": torch.arange(4.0)}, {"k": 2})
    _, manifest, objs = read_checkpoint(tmp_path, None, ["common.pt", "rank0_states.pt"])
    assert path == tmp_path / "t1" and manifest["meta"] == {"k": 2}
    assert torch.equal(objs["rank0_states.pt"]["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t1"]   # no staging left


def test_a_share_that_cannot_be_written_commits_nothing(tmp_path):
    write_sharded_checkpoint(Partition(), tmp_path, "t1", {"common.pt": 1}, "rank0_states.pt", 1)
    with pytest.raises(CheckpointError, match="saving checkpoint .* failed: rank 0: "
                                              "CheckpointError: cannot save rank0_states.pt"):
        write_sharded_checkpoint(Partition(), tmp_path, "t1", {"common.pt": 2},
                                 "rank0_states.pt", {"f": Partition})   # not weights-only
    _, _, objs = read_checkpoint(tmp_path, "t1", ["common.pt"])
    assert objs["common.pt"] == 1                                         # the old one stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t1"]
