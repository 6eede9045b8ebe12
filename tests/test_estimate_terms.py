"""`zenflow estimate`'s named costs against the code they model: the bus bytes the optimizer
itself counts, the page-locked bytes of the rule zenflow/host/pipeline.py pins by, by hand."""
import pytest
import torch

import zenflow
from zenflow.tools import estimate_terms as cost
from zenflow.tools.bench.model import GPT, GPTConfig
from zenflow.tools.estimate import GIB, estimate
from zenflow.tools.estimate_shapes import llama_shapes

LLAMA2_7B = dict(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32)
P_MAT = 2 * 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 11008 * 4096)   # every matrix
SMALL = dict(arch="llama", n_layer=2, n_embd=64, n_head=4, ffn=160, vocab_size=256, seq_len=8)


@pytest.mark.parametrize("budget, credit, sum_dtype, dtype", [
    (0, "mean", "float32", torch.float32),               # every sum on the host
    (10 ** 9, "mean", "float32", torch.float32),         # every sum on the device
    (10 ** 9, "mean", "bfloat16", torch.float32),        # bf16 device sums
    (10 ** 9, "moments", "float32", torch.float32),      # squares down, rates up
    (10 ** 9, "moments", "float32", torch.bfloat16),     # bf16 rows and rates
    (250_000, "mean", "float32", torch.float32),         # some sums on the device, some not
    (10 ** 9, "factored", "float32", torch.float32),     # row and column sums down, factors up
    (10 ** 9, "factored", "bfloat16", torch.bfloat16),   # bf16 sums under "factored"
])
def test_the_bus_bytes_are_what_the_optimizer_counts(budget, credit, sum_dtype, dtype):
    """Windows of 3 steps without overlap, on the CPU: the optimizer's own count of the bytes it
    copied each way over 4 windows is 4 windows of the estimate's bus terms."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).to(dtype)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    settings = dict(topk_ratio=0.1, overlap_step=False, update_interval=3,
                    device_sum_budget=budget, deferred_credit=credit, device_sum_dtype=sum_dtype)
    r = estimate(shapes, dtype, target="cpu", overlap=False, topk_ratio=0.1, update_interval=3,
                 device_sum_budget=budget, deferred_credit=credit, device_sum_dtype=sum_dtype)
    x = torch.randint(0, 256, (2, 8))
    with zenflow.ZenFlowAdamW(model.parameters(), worker=False, **settings) as opt:
        for _ in range(12):
            model(x, x).float().backward()
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
    bus, g = r["bus"]["zenflow"], r["per_gpu"]
    assert stats["windows"] == 4
    assert stats["d2h_bytes_total"] == 4 * bus["d2h_bytes_per_window"]
    assert stats["h2d_bytes_total"] == 4 * bus["h2d_bytes_per_window"]
    assert stats["device_sum_bytes"] == g["device_sum_bytes"]
    assert (stats["device_sum_matrices"], stats["moments_matrices"]) == (
        g["device_sum_matrices"], g["moments_matrices"])
    if budget == 250_000:
        assert 0 < g["device_sum_matrices"] < g["device_sum_matrices"] + g["host_sum_matrices"]


def test_the_factored_bytes_per_step_by_hand():
    """The "factored" add in bf16 with bf16 sums: the sum (2 + 4), the squares (2 + 4 widened,
    2 x 8 scaled and masked, 8 squared, 8 reduced twice) and the interim step (2 + 4 kept,
    5 x 8 by alpha, beta, coef and clamped twice, 2 + 4 + 2 added): 86 bytes a parameter, and
    the two fingerprints around the move; its device memory is the sum and 8 R + 12 C."""
    c = cost.Counts(item=2, rate_item=2, sum_item=2, world=1, params=12, vector_params=0,
                    selected_params=0, touched_bytes=0, rank_matrix_params=12,
                    deferred_params_all=12, host_summed=0, device_plain=0, device_moments=0,
                    offload_params=12, device_factored=12, factored_rows=3, factored_cols=4)
    assert cost.factored_squares_bytes(c) == 6 + 16 + 8 + 8
    assert cost.factored_interim_bytes(c) == 6 + 40 + 8
    assert cost.sum_add_bytes(c) == 12 * 6 + 12 * (38 + 54)
    assert cost.device_sums_bytes(c) == 12 * 2 + 8 * 3 + 12 * 4
    speeds = cost.Speeds(host_adamw=1, host_accumulate=1, host_factored=1, device_adamw=1, norm=1, copy=100.0,
                         fingerprint=50.0, d2h=1, h2d=1)
    assert cost.sum_add_s(c, speeds) == pytest.approx(12 * (6 + 92) / 100 + 2 * 2 * 12 / 50)
    # per window: its start and its install; not its end (looked at around every step's move)
    assert cost.fingerprint_s(c, speeds) == pytest.approx(2 * 2 * 12 / 50)
    # On rank 0 of 2 DDP replicas of a [6, 4] matrix (its 3 rows are the 12 above): the interim
    # step moves the other rank's 12 values too, and the device holds (and each install gathers)
    # the other rank's alpha of 3 rows and beta of 4 columns.
    ddp = cost.Counts(**{**c.__dict__, "world": 2, "deferred_params_all": 24,
                         "factored_other_factors": 3 + 4, "factored_other_params": 12})
    assert cost.sum_add_bytes(ddp) == cost.sum_add_bytes(c) + 12 * 54
    assert cost.device_sums_bytes(ddp) == cost.device_sums_bytes(c) + 4 * 7
    assert cost.install_allgather_bytes(ddp) == 2 * 12 + 4 * 7


def test_the_moments_bytes_per_step_by_hand():
    """The "moments" add in bf16: the sum (2 + 8), the squares (2 + 4 widened, 4 + 4 scaled,
    4 + 4 + 4 added) and the bounded interim step (2 + 2 zeroed, 2 + 2 + 2 by the rate, 3 x 4
    scaled and clamped, 2 + 2 + 2 added): 64 bytes a parameter, as tests/test_estimate.py has it."""
    c = cost.Counts(item=2, rate_item=2, sum_item=4, world=1, params=10, vector_params=0,
                    selected_params=0, touched_bytes=0, rank_matrix_params=10,
                    deferred_params_all=10, host_summed=0, device_plain=0, device_moments=10,
                    offload_params=10)
    assert cost.squares_bytes(c) == 6 + 8 + 12
    assert cost.interim_step_bytes(c) == 4 + 6 + 12 + 6
    assert cost.sum_add_bytes(c) == 10 * 64
    # fp32 weights and rates: every pass 4 bytes a value
    wide = cost.Counts(**{**c.__dict__, "item": 4, "rate_item": 4})
    assert cost.interim_step_bytes(wide) == 8 + 12 + 24 + 12
    assert cost.correction_bytes(c) == 10 * ((4 + 2 + 4) + 16 + (4 + 2 + 2))


def _pinned(**settings):
    settings.setdefault("device_sum_dtype", "float32")   # fp32 sum slots, as counted below
    r = estimate(llama_shapes(**LLAMA2_7B), torch.bfloat16, gpu_memory_bytes=80 * GIB,
                 **settings)
    return r["per_host"]["zenflow"]["pinned_bytes"], r["per_gpu"]


def test_page_locked_bytes_follow_where_the_sums_are():
    """On CUDA the optimizer locks the install buffers, the rates ("moments") and the steps'
    factors always; the two bf16 staging slots only when some sum is on the host; the fp32 sum
    slots only over the matrices summed on the device."""
    coefs = 2 * 4   # a 4-byte factor per staging slot
    # "moments" on one GPU: every sum on the device, 2 slots; its rates; no staging.
    pinned, g = _pinned(deferred_credit="moments")
    assert g["host_sum_matrices"] == 0
    assert pinned == 2 * P_MAT + 2 * P_MAT + 2 * 4 * P_MAT + coefs        # 75.3 GiB, not 50.2
    # The defaults ("factored"): the same without the rates (its O(rows + cols) factors left out)
    assert _pinned()[0] == 2 * P_MAT + 2 * 4 * P_MAT + coefs
    # Every sum on the host: staging and installs, no rates (no "moments" without device sums).
    assert _pinned(device_sum_budget=0)[0] == 2 * 2 * P_MAT + 2 * P_MAT + coefs
    # "mean" without overlap: one sum slot.
    assert _pinned(deferred_credit="mean", overlap=False)[0] == 2 * P_MAT + 4 * P_MAT + coefs
    # "moments" without overlap still has two: the squares land in the other.
    pinned, _ = _pinned(overlap=False, deferred_credit="moments")
    assert pinned == 2 * P_MAT + 2 * P_MAT + 2 * 4 * P_MAT + coefs
    # A budget that holds the embedding's fp32 sum alone ("mean": 4 bytes a parameter): the
    # staging slots over every other matrix, the sum slots over the embedding.
    embedding = 32000 * 4096
    pinned, g = _pinned(device_sum_budget=4 * embedding, deferred_credit="mean")
    assert (g["device_sum_matrices"], g["host_sum_matrices"]) == (1, 225)
    assert pinned == (2 * 2 * (P_MAT - embedding) + 2 * P_MAT + 2 * 4 * embedding + coefs)


def test_page_locked_spans_run_from_the_first_matrix_to_the_last():
    """The code locks one span per slot, from the first matrix of its kind to the end of the
    last: a host-summed matrix between two device-summed ones is inside the sums' span."""
    a, b, c = 100 * 100, 300 * 100, 50 * 100
    r = estimate([("a", (100, 100)), ("b", (300, 100)), ("c", (50, 100))], torch.bfloat16,
                 deferred_credit="mean", device_sum_budget=4 * (a + c))   # b does not fit
    assert (r["per_gpu"]["device_sum_matrices"], r["per_gpu"]["host_sum_matrices"]) == (2, 1)
    install, staging, sums = 2 * (a + b + c), 2 * 2 * b, 2 * 4 * (a + b + c)
    assert r["per_host"]["zenflow"]["pinned_bytes"] == install + staging + sums + 2 * 4


def test_page_locked_bytes_of_data_parallel_ranks_add_up():
    """Four replicas ("mean": DDP takes no "moments"), every row count divisible by 4: each rank
    locks its rows' install and sum slots, so together the one-GPU bytes plus 3 more factors."""
    one, _ = _pinned(deferred_credit="mean")
    four, g = _pinned(deferred_credit="mean", gpus=4)
    assert g["host_sum_matrices"] == 0
    assert one == 2 * P_MAT + 2 * 4 * P_MAT + 2 * 4
    assert four == one + 3 * 2 * 4


def test_the_report_says_which_bytes_are_page_locked(capsys):
    from zenflow.tools.cli import main
    assert main(["estimate", "--shapes", "1024x1024*8,1024*8"]) == 0
    out = capsys.readouterr().out
    assert "page-locked" in out and "staging+install" not in out


def test_the_python_threads_time_by_hand():
    """step()'s time on the training thread (estimate_terms.python_step_s, python_window_s): 40
    matrices, 30 with their sums on the device, 20 of those "factored" and compiled, in runs of
    16: a step dispatches 29 + 4 x 10 + 3 x 30 + 0 x 20 operators and makes 1 + 4 compiled
    calls; a
    window 25 + 4 x 10 + 5 x 10 + 9 x 20 operators and 2 calls (the installs' corrections,
    in runs of 16)."""
    c = cost.Counts(item=2, rate_item=2, sum_item=2, world=1, params=400, vector_params=0,
                    selected_params=0, touched_bytes=0, rank_matrix_params=400,
                    deferred_params_all=400, host_summed=100, device_plain=100, device_moments=0,
                    offload_params=400, device_factored=200, fused_factored=True, matrices=40,
                    device_summed_matrices=30, factored_matrices=20)
    speeds = cost.Speeds(host_adamw=1, host_accumulate=1, host_factored=1, device_adamw=1, norm=1,
                         copy=1, fingerprint=1, d2h=1, h2d=1, operator=1e-5, compiled_call=1e-3)
    assert cost.python_step_s(c, speeds, 16) == pytest.approx(159 * 1e-5 + 5 * 1e-3)
    assert cost.python_window_s(c, speeds, 16) == pytest.approx(295 * 1e-5 + 2 * 1e-3)
    eager = cost.Counts(**{**c.__dict__, "fused_factored": False})   # no compiled calls
    assert cost.python_step_s(eager, speeds, 16) == pytest.approx(159 * 1e-5)


def test_a_short_step_warns_that_it_may_be_cpu_bound():
    """The selftest's 1.35B shape at 45 ms of forward+backward (the H100's speed check, where
    step() made the step 1.6-2.7x AdamW's): step()'s Python thread is more than half of it, the
    step at least that, and the answer says so; Llama-2-7B at 0.5 s is not at risk."""
    from zenflow.tools.estimate_answer import answer
    figures = {"host_adamw_params_per_s": 4e9, "host_accumulate_params_per_s": 8e9,
               "host_factored_params_per_s": 4e9}
    common = dict(gpus=1, gpu_memory_bytes=80 * GIB, measured=figures)
    short = estimate(llama_shapes(hidden=2048, layers=24, intermediate=5504, vocab=32000,
                                  heads=16), torch.bfloat16, fwd_bwd_s=0.045,
                     activation_bytes=4 * GIB, **common)
    tm = short["time"]
    assert tm["cpu_bound_risk"] and tm["zenflow_python_s"] > 0.5 * 0.045
    assert tm["zenflow_step_s"] >= tm["zenflow_python_s"]
    assert any("CPU-BOUND RISK" in line for line in answer(short))
    long = estimate(llama_shapes(hidden=4096, layers=32, intermediate=11008, vocab=32000,
                                 heads=32), torch.bfloat16, fwd_bwd_s=0.5,
                    activation_bytes=20 * GIB, **common)
    assert not long["time"]["cpu_bound_risk"]
    assert not any("CPU-BOUND RISK" in line for line in answer(long))


def test_the_operator_counts_are_what_step_dispatches():
    """The Python-thread terms' constants are step()'s operators as the code dispatches them
    (benchmarks/step_operators.py's count, here at 8 and 24 matrices): a change that adds
    operators a matrix must change the estimate with it."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "benchmarks" / "step_operators.py"
    spec = importlib.util.spec_from_file_location("step_operators", path)
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    sizes = [8, 24]
    for placement, per_step, per_window in [
            ("host", cost.STEP_OPERATORS_PER_MATRIX["host"],
             cost.WINDOW_OPERATORS_PER_MATRIX["host"]),
            ("device", cost.STEP_OPERATORS_PER_MATRIX["device"],
             cost.WINDOW_OPERATORS_PER_MATRIX["device"]),
            ("factored", cost.STEP_OPERATORS_PER_MATRIX["device"] + cost.STEP_OPERATORS_PER_FACTORED,
             cost.WINDOW_OPERATORS_PER_MATRIX["factored"])]:
        counts = [counter.count(n, placement, steps=12) for n in sizes]
        step = counter.fit(sizes, [c["step"] for c in counts])
        window = counter.fit(sizes, [c["window"] for c in counts])
        assert step[1] == pytest.approx(per_step, abs=0.5), (placement, step)
        assert window[1] == pytest.approx(per_window, abs=1.5), (placement, window)
        assert step[0] == pytest.approx(cost.STEP_OPERATORS, abs=10), (placement, step)


def test_a_reselection_by_hand():
    """Every selected column moving: the rank's host state by the column-move rate, each moving
    value's three fp32 words down and back up, and on the device the three [rows, k] states
    (four passes each) and the weights' lines the new columns lie in, read and written; nothing
    where the device holds no column."""
    c = cost.Counts(item=2, rate_item=2, sum_item=2, world=1, params=100, vector_params=0,
                    selected_params=10, touched_bytes=64, rank_matrix_params=100,
                    deferred_params_all=100, host_summed=0, device_plain=100, device_moments=0,
                    offload_params=100)
    speeds = cost.Speeds(host_adamw=1, host_accumulate=1, host_factored=1, device_adamw=1,
                         norm=1, copy=1000.0, fingerprint=1, d2h=240.0, h2d=120.0,
                         host_reselect=50.0)
    assert cost.reselect_s(c, speeds) == pytest.approx(
        100 / 50 + 12 * 10 / 240 + 12 * 10 / 120 + (4 * 12 * 10 + 2 * 64) / 1000)
    assert cost.reselect_s(cost.Counts(**{**c.__dict__, "selected_params": 0}), speeds) == 0.0
    # every column the device's (topk_ratio 1): none deferred, none to move
    assert cost.reselect_s(cost.Counts(**{**c.__dict__, "deferred_params_all": 0}), speeds) == 0.0
