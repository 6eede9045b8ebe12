"""The batched column gather and scatter of a step (zenflow/optim/columns.py) against the one-
matrix versions, over matrices of mixed dtypes and in runs small enough to split."""
import torch

from zenflow.optim import columns


def _matrices(gen):
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
    shapes = [(6, 9), (4, 7), (5, 8), (3, 11), (2, 5)]
    mats = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]
    index = [torch.randperm(s[1], generator=gen)[:3].sort().values for s in shapes]
    return mats, index


def test_gather_and_scatter_of_many_equal_one_at_a_time(monkeypatch):
    monkeypatch.setattr(columns, "_CHUNK_ELEMENTS", 10)   # a run of at most a matrix or two
    gen = torch.Generator().manual_seed(0)
    mats, index = _matrices(gen)
    outs = [torch.empty(m.shape[0], 3) for m in mats]
    columns.gather_columns_of(mats, index, outs)
    for m, i, out in zip(mats, index, outs):
        assert torch.equal(out, columns.gather_columns(m, i, torch.empty_like(out)))
    values = [torch.randn(o.shape, generator=gen) for o in outs]
    batched, single = [m.clone() for m in mats], [m.clone() for m in mats]
    columns.scatter_columns_of(batched, index, values)
    for m, i, v in zip(single, index, values):
        columns.scatter_columns(m, i, v)
    for a, b in zip(batched, single):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_gather_on_several_threads_equals_index_select():
    """In host memory with more than one torch thread gather_columns takes torch.gather (a
    reselection's host columns on every core): the same values as index_select, converted."""
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for dtype in (torch.float32, torch.bfloat16):
                m = torch.randn(37, 50, generator=gen).to(dtype)
                i = torch.randperm(50, generator=gen)[:9].sort().values
                out = columns.gather_columns(m, i, torch.empty(37, 9))
                assert torch.equal(out, m.index_select(1, i).float())
    finally:
        torch.set_num_threads(threads)
