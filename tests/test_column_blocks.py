"""Alike small matrices (an MoE's experts) keep their device columns side by side in a
ColumnBlock, so that a step gathers, updates and scatters them in a few launches: the results
must be exactly those of the per-matrix path (device_adam.STACK_ELEMENTS = 0 turns blocks off)."""
from __future__ import annotations

import pytest
import torch

import zenflow
from zenflow.host import layout
from zenflow.optim import device_adam, handoff
from zenflow.optim.device_adam import ColumnBlock, runs_of


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    # interleaved as an MoE's experts' matrices are (w1, w2 of expert 0, then of expert 1, ...)
    shapes = [(8, 8), (8, 16)] * 3 + [(8, 8)] * 6 + [(4, 2, 3)] * 2 + [(300, 300), (8,), (16,)]
    return [torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.1).to(dtype)) for s in shapes]


# where the window sums are: the host's, the device's under "mean", the default rule's (also with
# the host's moments in bf16)
SUMS = {"host": {"device_sum_budget": 0},
        "device": {"device_sum_budget": 1 << 30, "deferred_credit": "mean"},
        "factored": {"device_sum_budget": 1 << 30},
        "factored, bf16 host moments": {"device_sum_budget": 1 << 30,
                                        "host_moments_dtype": "bfloat16"}}


def _train(dtype: torch.dtype, sums: str = "host", steps: int = 12, warm_up: int = 0):
    """A run with a reselection, a step where one block member has no gradient, and writes
    through .data (one into a device-owned column); returns the optimizer's blocks, the weights
    and the state. `warm_up`: full_warm_up_rounds (the first selection then takes moments the
    host has stepped, and its counts)."""
    params = _params(dtype)
    opt = zenflow.ZenFlowAdamW(params, lr=1e-2, worker=False, update_interval=2, topk_ratio=0.25,
                               select_strategy="step", select_interval=5, weight_decay=0.01,
                               full_warm_up_rounds=warm_up, **SUMS[sums])
    gen = torch.Generator().manual_seed(1)
    try:
        for t in range(steps):
            for i, p in enumerate(params):
                p.grad = None if (t == 7 and i == 3) else torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
            if t == 4:
                params[2].data.mul_(0.5)            # every column, found at a window's end
            if t in (5, 10):   # inside a window: the device's columns are adopted at once
                params[5].data[:, :].add_(0.25)
        blocks = {id(m.selected.block) for m in opt._host_params if m.selected.block is not None}
        return len(blocks), [p.detach().clone() for p in params], opt.state_dict()
    finally:
        opt.close()


def _assert_same(got, want, where=()):
    """Every tensor of a state, nested dicts and lists included, bit for bit."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            _assert_same(got[key], want[key], (*where, key))
    elif isinstance(want, (list, tuple)):
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, (*where, j))
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


@pytest.mark.parametrize("sums", list(SUMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_train_exactly_as_the_per_matrix_path(monkeypatch, dtype, sums):
    """Their selections too: a whole block's columns come from the host at once
    (handoff.take_block_from_host) and move at once (move_block_columns), with the same values
    as one matrix at a time."""
    moved, taken = [], []
    block_move, block_take = handoff.move_block_columns, handoff.take_block_from_host
    monkeypatch.setattr(handoff, "move_block_columns",
                        lambda block, *a: moved.append(block.size) or block_move(block, *a))
    monkeypatch.setattr(handoff, "take_block_from_host",
                        lambda block, *a: taken.append(block.size) or block_take(block, *a))
    blocks, weights, state = _train(dtype, sums)
    assert sorted(moved) == [2, 2, 3, 3, 9, 9]   # each block, at both reselections
    assert sorted(taken) == [2, 3, 9]            # ... and at the first selection
    monkeypatch.setattr(device_adam, "STACK_ELEMENTS", 0)
    monkeypatch.setattr(layout, "STACK_ELEMENTS", 0)   # nor back-to-back copies
    none, expected, expected_state = _train(dtype, sums)
    assert blocks == 3 and none == 0   # the 8x8s, the 8x16s and the [4, 6]s; not the 300x300
    for got, want in zip(weights, expected):
        assert torch.equal(got, want)
    _assert_same(state["state"], expected_state["state"])


def test_a_first_selection_after_warm_up_rounds_takes_the_hosts_state_as_each_matrix_does(
        monkeypatch):
    """After full_warm_up_rounds the host has stepped every matrix: the block's first selection
    takes its moments and counts (handoff.take_block_from_host) as one matrix at a time does."""
    blocks, weights, state = _train(torch.bfloat16, warm_up=3)
    monkeypatch.setattr(device_adam, "STACK_ELEMENTS", 0)
    monkeypatch.setattr(layout, "STACK_ELEMENTS", 0)
    none, expected, expected_state = _train(torch.bfloat16, warm_up=3)
    assert blocks == 3 and none == 0
    for got, want in zip(weights, expected):
        assert torch.equal(got, want)
    _assert_same(state["state"], expected_state["state"])


def test_whole_blocks_in_slot_order_are_stacked_and_the_rest_single():
    block, members = ColumnBlock.of(3, rows=4, k=2, device=torch.device("cpu"))
    other, loose = ColumnBlock.of(2, rows=4, k=2, device=torch.device("cpu"))
    alone = device_adam.DeviceColumns.empty(4, 2, torch.device("cpu"))
    runs = runs_of([alone, *members, loose[0]])   # the second block is not whole
    assert runs.stacked == [[1, 2, 3]] and runs.blocks == [block] and runs.single == [0, 4]
    runs = runs_of([members[1], members[0], members[2]])   # out of slot order
    assert runs.stacked == [] and runs.single == [0, 1, 2]
    # a step's blocks some of whose members have no gradient: two or more in slot order
    runs = runs_of([alone, members[0], members[2], loose[1]], partial=True)
    assert runs.stacked == [[1, 2]] and runs.blocks == [block] and runs.single == [0, 3]
    assert runs.slots[0].tolist() == [0, 2]
    runs = runs_of([*members, members[0]], partial=True)   # (a slot twice: not a block's)
    assert runs.stacked == [] and runs.single == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_and_put_are_each_members_gather_and_scatter(dtype):
    gen = torch.Generator().manual_seed(0)
    block, members = ColumnBlock.of(3, rows=4, k=2, device=torch.device("cpu"))
    for j, cols in enumerate(members):
        cols.column_indices.copy_(torch.tensor([[0, 3], [1, 2], [2, 5]][j]))
        cols.master.copy_(torch.randn(4, 2, generator=gen))
    matrices = [torch.randn(4, 6, generator=gen).to(dtype) for _ in members]
    taken = block.take(matrices)
    into = block.take(matrices, out=torch.empty(3, 4, 2))
    for j, cols in enumerate(members):
        assert torch.equal(taken[j], matrices[j].index_select(1, cols.column_indices))
        assert torch.equal(into[j], matrices[j].index_select(1, cols.column_indices).float())
    expected = [m.clone().index_copy_(1, c.column_indices, c.master.to(dtype))
                for m, c in zip(matrices, members)]
    block.put(matrices)
    for got, want in zip(matrices, expected):
        assert torch.equal(got, want)
    # some of the members (their slots): the others' columns are left as they were
    slots = torch.tensor([0, 2])
    grads = torch.zeros(3, 4, 2)
    block.take([matrices[0], matrices[2]], out=grads, slots=slots)
    assert torch.equal(grads[1], torch.zeros(4, 2))
    for j in (0, 2):
        assert torch.equal(grads[j], matrices[j].index_select(1, members[j].column_indices).float())
    for cols in members:
        cols.master.add_(1.0)
    before = matrices[1].clone()
    block.put([matrices[0], matrices[2]], slots)
    assert torch.equal(matrices[1], before)
    for j in (0, 2):
        assert torch.equal(matrices[j].index_select(1, members[j].column_indices),
                           members[j].master.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacks_column_sums_are_each_matrixs_own(dtype):
    """The drift check and the selection sum a block's gradients as one stack: each matrix's
    sums must be exactly its own (columns.column_sums), or selections would differ."""
    from zenflow.optim import columns
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(8, 8), (300, 7), (9000, 3)]:   # the last in several row blocks
        stack = torch.randn(5, rows, cols, generator=gen).to(dtype)
        for of in (torch.square, torch.abs):
            together = columns.column_sums(stack, of)
            for j in range(5):
                assert torch.equal(together[j], columns.column_sums(stack[j], of))


@pytest.mark.slow
def test_selections_under_data_parallel_move_each_block_at_once(tmp_path):
    """2 gloo ranks, each host holding its rows of replicated experts (5-row ones split 3 + 2):
    the first selection and each reselection take or move each block's columns at once, every
    rank's rows gathered in one collective a kind (handoff.take_block_from_host,
    move_block_columns), with the same weights and each rank's same state, bit for bit, as one
    matrix at a time, and the replicas equal."""
    from helpers.block_ranks import run_block_ranks
    from helpers.spawn import assert_ok
    ranks = run_block_ranks(tmp_path)
    assert_ok(ranks)
    for r in ranks:
        stacked, single = r["stacked"], r["single"]
        assert stacked["reselections"] == single["reselections"] >= 2
        assert sorted(set(stacked["moved"])) == [4, 7] and not single["moved"]   # the 5x6s, 8x8s
        assert sorted(stacked["taken"]) == [4, 7] and not single["taken"]
        for got, want, other in zip(stacked["weights"], single["weights"],
                                    ranks[0]["stacked"]["weights"]):
            assert torch.equal(got, want) and torch.equal(got, other)
        _assert_same(stacked["state"]["state"], single["state"]["state"])
