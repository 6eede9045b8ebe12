"""Ranks that start apart, and matrices with fewer rows than ranks (issue 24, items 1 and 9)."""
import pytest
import torch

from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


def test_ranks_start_from_rank_0s_weights_and_tiny_heads_train(tmp_path):
    ranks = run_ranks(tmp_path, "unseeded", steps=6, timeout=150)
    for r in ranks:
        assert r is not None and "error" not in r, r and r.get("error")
    # The bare optimizer refuses replicas that differ, naming the parameter.
    for r in ranks:
        assert "params[0] (shape (16, 12)) differs between the 2 ranks" in r["bare"], r["bare"]
    # initialize broadcast rank 0's weights, and training (a 1-row head on 2 ranks) kept them
    # identical.
    for key in ("initial", "weights"):
        for name, value in ranks[0][key].items():
            assert torch.equal(value, ranks[1][key][name]), (key, name)
    assert any(not torch.equal(ranks[0]["initial"][n], v) for n, v in ranks[0]["weights"].items())
