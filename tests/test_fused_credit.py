"""deferred_credit="factored" in one kernel a matrix (zenflow/host/compiled.py,
factored_kernels.factored_step_): on a GPU its sum's add, statistics and interim step are compiled
into one or two passes. Here the fused function runs eagerly (the same arithmetic as the op-by-op
path, so the same bits), compiled by the CPU's backend (slow), and failing to compile."""
import logging
from unittest import mock

import pytest
import torch

from zenflow.host import compiled, credit_factored, factored_kernels
from zenflow.host.credit_base import MovingCredit

from helpers.reference import SHAPES, factored_against_reference

MATRICES = [i for i, s in enumerate(SHAPES) if len(s) >= 2]


def eager(fn, device, batch=False):
    """compiled_for's stand-in: the function itself, run eagerly (a batch's call names its
    signature, which only a compile needs)."""
    return (lambda *args, signature: fn(*args)) if batch else fn


def _train(dtype, sum_dtype, steps=16, skip_at=None):
    """factored_against_reference, with stats() counting "op_by_op_moves" and
    "op_by_op_corrections": the matrix steps and the installs' corrections the op-by-op path
    took."""
    moves, corrections = [], []
    correct = MovingCredit.correct

    def count_moves(opt):
        interim = opt._pipeline.credit.interim
        opt._pipeline.credit.interim = lambda weights, *a: (moves.append(len(weights)),
                                                            interim(weights, *a))
    with mock.patch.object(MovingCredit, "correct", lambda self, weights, *a: (
            corrections.append(len(weights)), correct(self, weights, *a))):
        ours, theirs, stats = factored_against_reference(dtype, sum_dtype, steps=steps,
                                                         skip_at=skip_at, before=count_moves)
    return ours, theirs, {**stats, "op_by_op_moves": sum(moves),
                          "op_by_op_corrections": sum(corrections)}


@pytest.fixture
def eager_fused(monkeypatch):
    """The fused step on the CPU, uncompiled: fused_step() calls factored_step_ itself."""
    monkeypatch.setattr(factored_kernels, "compiled_for", eager)


@pytest.mark.parametrize("batch", [None, 2, 3], ids=["per-matrix", "runs-of-2", "run-of-3+1"])
@pytest.mark.parametrize("dtype, sum_dtype", [(torch.float32, "float32"),
                                              (torch.bfloat16, "float32"),
                                              (torch.bfloat16, "bfloat16")])
def test_the_fused_step_gives_the_op_by_op_steps_bits(dtype, sum_dtype, batch, monkeypatch):
    """The fused step, a call a matrix, or runs of BATCH matrices a call (factored_steps_) and
    the rest a call each."""
    op_by_op, reference, plain = _train(dtype, sum_dtype)
    assert plain["fused_steps"] == 0
    assert plain["op_by_op_moves"] > 0 and plain["op_by_op_corrections"] > 0
    monkeypatch.setattr(factored_kernels, "compiled_for", eager)
    batches, kernels = [], []
    if batch:   # 4 matrices: runs of 2, or one of 3 and one matrix alone
        monkeypatch.setattr(credit_factored, "BATCH", batch)
        run_batch = credit_factored.FactoredCredit._run_batch
        monkeypatch.setattr(credit_factored.FactoredCredit, "_run_batch", lambda self, moving,
                            *a: batches.append(len(moving)) or run_batch(self, moving, *a))
        run = factored_kernels.Kernels.run
        monkeypatch.setattr(factored_kernels.Kernels, "run", lambda self, name, *a, **k:
                            kernels.append(name) or run(self, name, *a, **k))
    with mock.patch.object(factored_kernels.log, "warning") as warned:
        fused, _, stats = _train(dtype, sum_dtype)
    assert not warned.called, warned.call_args   # no run fell back to its matrices' kernels
    assert bool(batches) == bool(batch) and all(n == batch for n in batches)
    if batch:   # the installs' corrections in runs too (a lone matrix in a call of its own)
        assert "corrects" in kernels
    # the fused step took every matrix step the op-by-op path took, and left none to it; the
    # installs' corrections likewise
    assert (stats["fused_steps"], stats["op_by_op_moves"]) == (plain["op_by_op_moves"], 0)
    assert stats["op_by_op_corrections"] == 0
    for t, (a, b) in enumerate(zip(fused, op_by_op)):
        for p, q in zip(a, b):
            assert torch.equal(p, q), f"step {t}"
    if sum_dtype == "float32":   # the reference sums in fp32
        for t, (a, b) in enumerate(zip(fused, reference)):
            for p, q in zip(a, b):
                if dtype == torch.bfloat16:
                    assert torch.equal(p, q), f"step {t}"
                else:
                    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_moves_nothing_in_the_fused_step(eager_fused):
    """An inf gradient (a skipped step, coef 0) inside a window: the interim step is 0, not NaN,
    and the window is dropped, as on the op-by-op path."""
    fused, _, stats = _train(torch.bfloat16, "float32", steps=10, skip_at=5)
    assert stats["skipped_steps"] == 1 and stats["fused_steps"] > 0
    assert all(torch.isfinite(p).all() for p in fused[-1])
    for p, q in zip(fused[5], fused[4]):
        assert torch.equal(p, q)   # the skipped step moved nothing


def test_a_compile_that_fails_falls_back_to_the_op_by_op_step(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no compiler here")
    op_by_op, _, _ = _train(torch.bfloat16, "bfloat16", steps=8)
    monkeypatch.setattr(factored_kernels, "compiled_for", lambda fn, device, batch=False: broken)
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        fell_back, _, stats = _train(torch.bfloat16, "bfloat16", steps=8)
    assert stats["fused_steps"] == 0
    assert sum("the compiled step failed" in r.getMessage() for r in caplog.records) == 1
    for a, b in zip(fell_back, op_by_op):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, batch", [(torch.float32, False), (torch.bfloat16, False),
                                          (torch.bfloat16, True)])
def test_the_compiled_step_on_the_cpu_backend_equals_the_reference(dtype, batch, monkeypatch):
    """torch.compile of factored_step_, and of factored_steps_ (`batch`), by the CPU's C++
    backend: the code path a GPU takes with Triton. Its reductions may add in another order, so
    the statistics, and through the fit the rates, differ in the last bits: fp32 weights within
    1e-5, bf16 weights within 1 ulp."""
    pytest.importorskip("torch._inductor")
    monkeypatch.setattr(compiled, "COMPILE_ON", {"cuda", "cpu"})
    if batch:
        monkeypatch.setattr(credit_factored, "BATCH", 2)
    monkeypatch.setattr(compiled._Kernel, "_compiled", {})
    with mock.patch.object(factored_kernels.log, "warning") as warned:
        fused, reference, stats = _train(dtype, "float32")
    assert not warned.called, warned.call_args
    assert any(key[0] is factored_kernels.factored_steps_
               for key in compiled._Kernel._compiled) == batch
    assert stats["fused_steps"] > 0
    assert stats["op_by_op_moves"] == stats["op_by_op_corrections"] == 0
    for t, (a, b) in enumerate(zip(fused, reference)):
        for p, q in zip(a, b):
            if dtype == torch.bfloat16:
                ulp = q.float().abs().clamp_min(1e-30) * 2.0 ** -7
                assert ((p.float() - q.float()).abs() <= ulp).all(), f"step {t}"
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_selftest_check_of_the_compiled_step_passes_with_the_cpu_backend(monkeypatch):
    """`zenflow selftest`'s "compiled" section (what a GPU's Triton kernels are held to, in
    tests/test_cuda.py) run with the CPU's C++ backend: the check itself works; and it is
    skipped on a device that takes no compiled kernels."""
    from zenflow.tools import selftest_compiled
    from zenflow.tools.selftest_checks import _Ctx
    ctx = _Ctx(torch.device("cpu"), torch.float32, None, False)
    skipped, = selftest_compiled.compiled(ctx)
    assert skipped.status == "skip" and "COMPILE_ON" in skipped.detail
    monkeypatch.setattr(compiled, "COMPILE_ON", {"cuda", "cpu"})
    monkeypatch.setattr(credit_factored, "BATCH", 4)   # a GPU's is 16: a compile 4x as long
    check, batch, replica = selftest_compiled.compiled(ctx)
    assert check.status == "pass", check.detail
    assert batch.status == "pass" and "batch of 4" in batch.name, batch.detail
    assert replica.status == "pass" and "replica" in replica.name, replica.detail
    assert set(check.measured["max_diff"]) == {"weight", "grad_sum", "row_sq", "col_sq",
                                                "prints"}


def test_many_optimizers_and_dtypes_in_one_process_all_take_the_compiled_step(monkeypatch,
                                                                              caplog):
    """Dynamo compiles a function at most recompile_limit (8) ways; fp32 and bf16 weights and
    sums, calls with autograd on and off, and matrices of other shapes each make a way. On a GPU
    the selftest's sections ran out and fell back to the op-by-op path. Here (Dynamo's tracing,
    the "eager" backend) two optimizers a signature, and direct calls with autograd on, all
    take the compiled kernel, with no warning."""
    import torch._dynamo
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "COMPILE_ON", {"cuda", "cpu"})
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setattr(compiled._Kernel, "_compiled", {})
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        for _ in range(2):
            for dtype, sum_dtype in [(torch.float32, "float32"), (torch.bfloat16, "float32"),
                                     (torch.bfloat16, "bfloat16")]:
                _, _, stats = _train(dtype, sum_dtype, steps=8)
                assert stats["fused_steps"] > 0
                assert stats["op_by_op_moves"] == stats["op_by_op_corrections"] == 0
        step = compiled.compiled_for(factored_kernels.factored_step_, torch.device("cpu"))
        for rows, cols in ((3, 5), (64, 16), (7, 7), (1, 9), (9, 1)):
            weight = torch.zeros(rows, cols, dtype=torch.bfloat16, requires_grad=True)
            with torch.no_grad():
                weight.zero_()
            args = [weight, torch.ones(rows, cols, dtype=torch.bfloat16),
                    torch.zeros(rows, cols), torch.zeros(rows), torch.zeros(cols),
                    torch.ones(rows), torch.ones(cols), torch.ones(cols)]
            step(*args, *(compiled.scalar(v, torch.device("cpu")) for v in (1.0, -0.5, 3.0)))
            assert torch.equal(weight.detach(), torch.full((rows, cols), -0.5).bfloat16())
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_step_fingerprints_the_hosts_columns_before_and_after_its_move(dtype):
    """The prints factored_step_ takes in its pass are what zenflow/optim/outside_writes.py
    would read around the move: the host-owned columns' bit sums (column_bit_sums, the
    device-owned columns left out), modulo 2**32, before and after."""
    from zenflow.host.fingerprints import column_bit_sums
    gen = torch.Generator().manual_seed(3)
    rows, cols = 37, 23
    weight = (torch.randn(rows, cols, generator=gen) * 0.05).to(dtype)
    grad = torch.randn(rows, cols, generator=gen).to(dtype)
    host_cols = torch.ones(cols)
    host_cols[[0, 5, 22]] = 0.0   # the device's columns

    def printed(w):
        return int(column_bit_sums(w)[host_cols != 0].sum(dtype=torch.int32))
    want_before = printed(weight)
    prints = torch.empty(2, dtype=torch.int32)
    args = [weight, grad, torch.zeros(rows, cols), torch.zeros(rows), torch.zeros(cols),
            torch.rand(rows, generator=gen) + 0.5, torch.rand(cols, generator=gen),
            host_cols] + [compiled.scalar(v, torch.device("cpu")) for v in (1.0, -1e-2, 3.0)]
    factored_kernels.factored_step_(*args, prints)
    assert prints.tolist() == [want_before, printed(weight)]
    assert want_before != printed(weight)   # it moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_correction_fingerprints_the_hosts_columns_it_corrected(dtype):
    """The print factored_correct_ takes in its pass is what zenflow/optim/outside_writes.py
    would read after the install: the corrected host-owned columns' bit sums (the device's
    columns left out), modulo 2**32."""
    from zenflow.host.fingerprints import column_bit_sums
    gen = torch.Generator().manual_seed(4)
    rows, cols = 29, 17
    weight = (torch.randn(rows, cols, generator=gen) * 0.05).to(dtype)
    host_cols = torch.ones(cols)
    host_cols[[1, 16]] = 0.0   # the device's columns
    before = int(column_bit_sums(weight)[host_cols != 0].sum(dtype=torch.int32))
    printed = torch.empty((), dtype=torch.int32)
    factored_kernels.factored_correct_(
        weight, torch.randn(rows, cols, generator=gen), torch.rand(rows, generator=gen) + 0.5,
        torch.rand(cols, generator=gen) * host_cols,
        *(compiled.scalar(v, torch.device("cpu")) for v in (-1e-2, 6.0)), host_cols, printed)
    after = int(column_bit_sums(weight)[host_cols != 0].sum(dtype=torch.int32))
    assert int(printed) == after != before   # it corrected, and printed what it wrote


def test_a_batch_traced_by_dynamo_gives_the_op_by_op_bits(monkeypatch, caplog):
    """factored_steps_ as torch.compile traces it (Dynamo, fullgraph, static shapes; its
    "eager" backend runs the traced graph): every matrix of a step in one compiled call, the
    op-by-op path's bits, a compile per set of matrices, and no fallback."""
    import torch._dynamo
    torch._dynamo.reset()
    op_by_op, _, _ = _train(torch.bfloat16, "bfloat16", steps=8)
    monkeypatch.setattr(compiled, "COMPILE_ON", {"cuda", "cpu"})
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setattr(compiled._Kernel, "_compiled", {})
    monkeypatch.setattr(credit_factored, "BATCH", 2)
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        batched, _, stats = _train(torch.bfloat16, "bfloat16", steps=8)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert stats["fused_steps"] > 0 and stats["op_by_op_moves"] == 0
    assert any(key[0] is factored_kernels.factored_steps_ for key in compiled._Kernel._compiled)
    for a, b in zip(batched, op_by_op):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_a_batch_whose_compile_fails_leaves_its_matrices_to_their_own_kernels(monkeypatch,
                                                                             caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler for lists here")
    monkeypatch.setattr(factored_kernels, "compiled_for",
                        lambda fn, device, batch=False: broken if batch else fn)
    monkeypatch.setattr(credit_factored, "BATCH", 2)
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        fell_back, _, stats = _train(torch.bfloat16, "bfloat16", steps=8)
    monkeypatch.setattr(factored_kernels, "compiled_for", eager)
    monkeypatch.setattr(credit_factored, "BATCH", 10 ** 6)
    per_matrix, _, want = _train(torch.bfloat16, "bfloat16", steps=8)
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    # once for the steps' runs and once for the corrections'
    assert len(warned) == 2 and all("a kernel a matrix runs instead" in w for w in warned)
    assert {w.split("compiled ")[1].split(" ")[0] for w in warned} == {"steps", "corrects"}
    assert stats["fused_steps"] == want["fused_steps"] > 0 and stats["op_by_op_moves"] == 0
    assert stats["op_by_op_corrections"] == 0
    for a, b in zip(fell_back, per_matrix):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
