"""The costs `zenflow estimate` adds up, one function each: bytes over the bus, passes of the
host, passes of the device and installs. Each states its formula in code and, in one line, why
the code as written pays it (the module that pays it is named). Every function reads `Counts`
(how many parameters of which kind, for rank 0, the largest share) and, for times, `Speeds`.

Byte counts of a device pass are what the kernel reads plus what it writes; a pass takes its
bytes over `Speeds.copy`, the device's reads plus writes a second (`zenflow selftest`'s
device_pass_bytes_per_s; unmeasured, twice the bytes a copy copies a second:
benchmarks/pass_bytes.py checks the relation). Nothing here knows about windows or step times:
that is estimate_time.py.
"""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4          # bytes of an fp32 value (the host's state, the sums, the squares)
CACHE_LINE = 64   # bytes: gathering a column reads the whole line it lies in


@dataclass(frozen=True)
class Counts:
    """What the costs count, in parameters of rank 0 (the largest share: ceil(rows / world)
    rows of every matrix) unless a field says otherwise."""
    item: int                # bytes of a weight and of a gradient (the parameters' dtype)
    rate_item: int           # bytes of a "moments" rate (host/layout.py rate_dtype)
    sum_item: int            # bytes of a device sum not under "moments" (4 fp32, 2 bf16)
    world: int               # data-parallel ranks on the host
    params: int              # every parameter (all ranks hold all of them on the device)
    vector_params: int       # of them in vectors (always on the device)
    selected_params: int     # rows * k of every matrix: the device's own columns
    touched_bytes: int       # bytes of the 64-byte lines the selected columns lie in
    rank_matrix_params: int  # the rank's rows of every matrix (its host state)
    deferred_params_all: int  # every row of the matrices with deferred columns
    host_summed: int         # the rank's rows of deferred matrices summed on the host
    device_plain: int        # ... summed on the device, deferred_credit "mean"/"window"
    device_moments: int      # ... summed on the device under deferred_credit "moments"
    offload_params: int      # OffloadAdamW's host share: the rank's rows of every parameter
    device_factored: int = 0  # the rank's rows of deferred matrices under "factored"
    factored_rows: int = 0    # ... their rows, and their columns: the O(rows + cols) statistics
    factored_cols: int = 0    # and factors beside each sum (host/credit_factored.py)
    # DDP's replicas (host/credit_replicas.py): the other ranks' factors of the "factored"
    # matrices, which every replica holds and gathers at each install (fp32 values: alpha of
    # their rows, beta of their blocks), and the other ranks' rows, which its interim step moves
    factored_other_factors: int = 0
    factored_other_params: int = 0
    # the "factored" step is one compiled kernel a matrix (a GPU)
    fused_factored: bool = False
    # matrices: every one the rank steps, those whose sums are on the device, and of those the
    # ones "factored" moves (the Python thread's work goes by matrices, not bytes)
    matrices: int = 0
    device_summed_matrices: int = 0
    factored_matrices: int = 0

    @property
    def device_summed(self) -> int:
        return self.device_plain + self.device_moments + self.device_factored

    @property
    def moving(self) -> int:
        """The rank's rows of the matrices a credit rule moves every step on the device."""
        return self.device_moments + self.device_factored

    @property
    def deferred(self) -> int:
        """The rank's rows of every deferred matrix: what its host updates and installs."""
        return self.host_summed + self.device_summed


@dataclass(frozen=True)
class Speeds:
    """The figures the times divide by: parameters or bytes per second, the host's shared by
    the ranks (each rank's worker gets 1/world of it)."""
    host_adamw: float        # parameters/s of this rank's worker
    host_accumulate: float   # parameters/s of this rank's worker
    host_factored: float     # parameters/s of this rank's worker, "factored" matrices' update
    device_adamw: float      # parameters/s
    norm: float              # gradient bytes/s read by the norm kernel
    copy: float              # bytes/s a device pass reads plus writes (about 2 x a copy's)
    fingerprint: float       # weight bytes/s read by a fingerprint
    d2h: float               # bytes/s device -> host (a CPU device: memcpy)
    h2d: float               # bytes/s host -> device (a CPU device: memcpy)
    operator: float = 25e-6  # the training thread's seconds per operator step() dispatches
    compiled_call: float = 0.5e-3   # ... per call of a compiled "factored" kernel
    host_reselect: float = 0.8e9     # parameters/s of a reselection's host column moves


# ------------------------------------------------------------------------------- bus bytes
def host_rows_d2h_bytes(c: Counts) -> int:
    """Per step: a host-summed matrix's rows cross in the weights' dtype and the worker adds
    them (host/pipeline.py stage)."""
    return c.item * c.host_summed


def window_sums_d2h_bytes(c: Counts) -> int:
    """Per window: each device sum crosses once in its own dtype; a "moments" matrix sends its
    fp32 sum and its fp32 squares, a "factored" one its sum (host/device_sums.py copy_out)."""
    return (c.sum_item * (c.device_plain + c.device_factored)
            + (FP32 + FP32) * c.device_moments
            + FP32 * (c.factored_rows + 2 * c.factored_cols))   # row, column sums; the mask


def install_h2d_bytes(c: Counts) -> int:
    """Per window: the host's new values of the rank's rows come up in the weights' dtype, and
    a "moments" matrix's rates with them, a "factored" one's factors (host/layout.py
    install_*, rate_*, factors)."""
    return (c.item * c.deferred + c.rate_item * c.device_moments
            + FP32 * (c.factored_rows + c.factored_cols))


def install_allgather_bytes(c: Counts) -> int:
    """Per window, several ranks: every rank installs its rows and all-gathers the other ranks'
    on the device (NCCL; DDP's replicas must end equal), and the other ranks' "factored"
    factors."""
    if c.world == 1:
        return 0
    return c.item * (c.deferred_params_all - c.deferred) + FP32 * c.factored_other_factors


def offload_d2h_bytes(c: Counts) -> int:
    """Per step: ZeRO-Offload sends every gradient of its rows to the host."""
    return c.item * c.offload_params


def offload_h2d_bytes(c: Counts) -> int:
    """Per step: and every weight comes back."""
    return c.item * c.params


def device_sums_bytes(c: Counts) -> int:
    """Device memory of the window sums (host/device_sums.py allocate): each in its dtype; a
    "moments" matrix's fp32 sum, its fp32 squares and its rates; a "factored" one's sum."""
    return (c.sum_item * (c.device_plain + c.device_factored)
            + (FP32 + FP32 + c.rate_item) * c.device_moments
            + 8 * c.factored_rows + 12 * c.factored_cols   # credit_factored.factor_bytes
            + FP32 * c.factored_other_factors)             # DDP: credit_replicas' too


# ------------------------------------------------------------------------------- host passes
def host_accumulate_s(c: Counts, s: Speeds) -> float:
    """Per step: the worker adds each host-summed row, times the step's factor, into its fp32
    sum (host/buffers.py accumulate)."""
    return c.host_summed / s.host_accumulate


def host_adamw_s(c: Counts, s: Speeds) -> float:
    """Per window: AdamW over the rank's rows of every deferred matrix; a "factored" matrix's
    update at its own rate (host/factored.py: two passes of row blocks, bound by arithmetic where
    the others are bound by memory). A bf16 device sum is widened chunk by chunk in cache inside
    the update that reads it (host/buffers.py _gradients, host/factored.py), not in a pass of its
    own: it reads half the sum's bytes from memory, and costs a one-core update 12% more here
    (16M parameters: 20.0 against 17.8 ms)."""
    return (c.deferred - c.device_factored) / s.host_adamw + c.device_factored / s.host_factored


def offload_host_s(c: Counts, s: Speeds) -> float:
    """Per step: ZeRO-Offload's host adds every gradient of its rows and runs AdamW on them."""
    return c.offload_params / s.host_accumulate + c.offload_params / s.host_adamw


# ------------------------------------------------------------------------------- device passes
def device_update_s(c: Counts, s: Speeds) -> float:
    """Per step: AdamW on the selected columns and the vectors; one read of every gradient for
    the global norm (clipping); the selected columns' gather, and the scatter back (a read and
    a write) of every cache line they lie in: 3 passes (optim/device_adam.py)."""
    return ((c.selected_params + c.vector_params) / s.device_adamw
            + c.item * c.params / s.norm
            + 3 * c.touched_bytes / s.copy)


def sum_add_bytes(c: Counts) -> int:
    """Per step, the device sums' add (host/device_sums.py add): one addcmul of the gradient
    times the step's factor (a device tensor, never read by the host) into the sum; "moments"
    also sums the squares and takes the interim step, "factored" the squares' row and column
    sums and its interim step at factored rates."""
    plain = c.item + 2 * c.sum_item               # read the gradient; read and write the sum
    moments_sum = c.item + 2 * FP32               # the same into an fp32 sum
    factored = (fused_factored_bytes(c) if c.fused_factored
                else plain + factored_squares_bytes(c) + factored_interim_bytes(c))
    # DDP: the interim step moves the other ranks' rows of the replica too; compiled, in the
    # same pointwise pass (the gradient read, the weight read and written)
    other = 3 * c.item if c.fused_factored else factored_interim_bytes(c)
    return (c.device_plain * plain
            + c.device_moments * (moments_sum + squares_bytes(c) + interim_step_bytes(c))
            + c.device_factored * factored
            + c.factored_other_params * other)


def fused_factored_bytes(c: Counts) -> int:
    """Per "factored" parameter and step, compiled (host/credit_factored.py factored_step_):
    the gradient read for its row sums, for its column sums and for the pointwise pass (the
    sum's add and the interim step: the loops the CPU backend writes; Triton may fuse the first
    into the last), the sum and the weight each read and written once."""
    return 3 * c.item + 2 * c.sum_item + 2 * c.item


def factored_squares_bytes(c: Counts) -> int:
    """Per "factored" parameter and step: the squares of the clipped gradient on the host's
    columns, reduced along rows and along columns (host/credit_factored.py add)."""
    widen = c.item + FP32                         # the gradient to fp32
    scale = 2 * (FP32 + FP32)                     # times the step's factor, times the mask
    square = FP32 + FP32                          # squared in place
    reduce = 2 * FP32                             # read once for the row sums, once for columns
    return widen + scale + square + reduce


def factored_interim_bytes(c: Counts) -> int:
    """Per "factored" parameter and step: -lr * clamp(coef * g * alpha_i * beta_j), in fp32
    (host/credit_factored.py interim)."""
    keep = c.item + FP32                          # the gradient zeroed on a skipped step, fp32
    in_place = 5 * (FP32 + FP32)                  # times alpha, beta, coef; clamped twice
    add = c.item + FP32 + c.item                  # added to the weight, rounded once
    return keep + in_place + add


def squares_bytes(c: Counts) -> int:
    """Per "moments" parameter and step: the squares the host's moments need, summed as the
    reference sums them, from an fp32 product (host/device_sums.py add)."""
    widen = c.item + FP32                         # the gradient to fp32
    scale = FP32 + FP32                           # times the step's factor
    add_square = FP32 + FP32 + FP32               # the product read once; the squares r/w
    return widen + scale + add_square


def interim_step_bytes(c: Counts) -> int:
    """Per "moments" parameter and step: the bounded interim step of a value the device does
    not update (host/device_sums.py move): -lr * clamp(coef * g * rate)."""
    wide = max(c.item, c.rate_item)               # the product's dtype
    keep = c.item + c.item                        # the gradient zeroed on a skipped step
    times_rate = c.item + c.rate_item + wide      # its product with the rate
    in_place = 3 * (wide + wide)                  # times coef, clamped below and above
    add = c.item + c.item + wide                  # added to the weight
    return keep + times_rate + in_place + add


def sum_add_s(c: Counts, s: Speeds) -> float:
    """Per step: the sums' add and the rule's device work, and the two fingerprints of the
    matrices the rule moves, before and after its move (optim/outside_writes.py watch_moves;
    the compiled "factored" step takes them in its own kernel, counted here as the same two
    reads: its reductions may share the kernel's reads, which the model does not assume)."""
    return sum_add_bytes(c) / s.copy + 2 * c.item * c.moving / s.fingerprint


def correction_bytes(c: Counts) -> int:
    """Per window: an install's bounded correction of each "moments" value, for the gradients
    summed since its update was handed off (host/device_sums.py correct)."""
    times_rate = FP32 + c.rate_item + FP32        # the sum times the rate, into fp32
    clamp = 2 * (FP32 + FP32)                     # clamped below and above, in place
    add = FP32 + c.item + c.item                  # added to the weight
    factored = (c.sum_item + FP32                 # the sum widened to fp32
                + 2 * (FP32 + FP32))              # times alpha, times beta
    if c.fused_factored:   # compiled (host/credit_factored.py factored_correct_)
        fused = c.sum_item + 2 * c.item           # the sum read; the weight read and written
        return c.device_moments * (times_rate + clamp + add) + c.device_factored * fused
    return c.device_moments * (times_rate + clamp + add) + c.device_factored * (factored + clamp
                                                                               + add)


def fingerprint_s(c: Counts, s: Speeds) -> float:
    """Per window: that nothing outside the optimizer wrote the weights (optim/outside_writes.py):
    a pass over every matrix at the window's start (writes through .data taken before it moves
    or selects) and one after its install (what the optimizer wrote), which the compiled
    "factored" correction takes in its own pass (not on DDP's replicas, which correct each
    rank's rows before gathering them); one more at its end over the matrices a credit rule
    does not move (those are checked around every step's move, sum_add_s). A one-step window
    takes its start's check for its end's: one pass fewer there than counted here."""
    printed = c.device_factored if c.fused_factored and not c.factored_other_params else 0
    passes = 3 * c.rank_matrix_params - c.moving - printed
    return c.item * passes / s.fingerprint


def reselect_s(c: Counts, s: Speeds) -> float:
    """Per reselection, the device waiting (optim/handoff.py move_columns), at worst every
    selected column changing: the rank's host state moved column by column (a gather and a
    scatter in each of its three buffers, host_reselect), each moving column's master value and
    moments down and back up over the bus (pageable: the page-locked figures bound it), and on
    the device the three [rows, k] states reshuffled (about four passes each) and the new columns
    written into the weights (the lines they lie in, read and written)."""
    if not c.selected_params or not c.deferred_params_all:   # no column can move
        return 0.0
    device_bytes = 4 * 3 * FP32 * c.selected_params + 2 * c.touched_bytes
    return (c.rank_matrix_params / s.host_reselect
            + 3 * FP32 * c.selected_params * (1 / s.d2h + 1 / s.h2d) + device_bytes / s.copy)


def offload_fingerprint_s(c: Counts, s: Speeds) -> float:
    """Per step: OffloadAdamW's windows are one step, so every parameter, every step."""
    return 2 * c.item * c.params / s.fingerprint


def offload_norm_s(c: Counts, s: Speeds) -> float:
    """Per step: OffloadAdamW clips too: one read of every gradient."""
    return c.item * c.params / s.norm


def adamw_device_s(c: Counts, s: Speeds) -> float:
    """Per step: torch's fused AdamW over every parameter: the floor's optimizer."""
    return c.params / s.device_adamw


# ------------------------------------------------------------------------------- installs
def install_device_s(c: Counts, s: Speeds) -> float:
    """Per window, on the device: the all-gather of the other ranks' rows and the "moments"
    correction, both waited for by the next forward."""
    # (the gathered bytes at a copy's rate: the all-gather's own is not modelled)
    return (2 * install_allgather_bytes(c) + correction_bytes(c)) / s.copy


def exposed_install_s(copy_s: list[float], forward_s: list[float]) -> float:
    """How long the forward waits for installs copied matrix by matrix in the model's order from
    the end of step() (copy_s) while each matrix's layer, taking forward_s, waits for its own:
    the largest lead of the copies up to a matrix over the forward before it. At least the first
    matrix's copy; at most the whole copy."""
    waited = copied = forwarded = 0.0
    for copy, forward in zip(copy_s, forward_s):
        copied += copy
        if copy:
            waited = max(waited, copied - forwarded)
        forwarded += forward
    return waited


def per_layer_install_wait_s(mats: list[tuple[int, int, int]], moving: set[int], item: int,
                             rate_item: int, h2d: float, forward_s: float, world: int = 1,
                             after_copy_s: float = 0.0) -> float:
    """Per window, the model attached: each layer's forward waits only for its own matrices'
    copy (optim/installs.py), so the device waits for what the forward before it does not hide.
    `mats`: (rows, columns, k), model order; `moving`: the indices of the deferred matrices
    (counted among those with k < columns) under "moments", whose rates come too; a matrix's
    share of the forward (a third of forward+backward) is its share of the parameters. Under
    DDP (`world` ranks) each rank copies its share of the rows, and `after_copy_s` (the
    correction and all-gather, on the copy stream after each copy) is spread over the deferred
    matrices by their share of the deferred parameters."""
    total = sum(r * c for r, c, _ in mats)
    deferred_total = sum(r * c for r, c, k in mats if k < c) or 1
    copy_s, deferred = [], 0
    for r, c, k in mats:
        if k < c:
            copy_s.append((item + (rate_item if deferred in moving else 0)) * r * c / world / h2d
                          + after_copy_s * r * c / deferred_total)
            deferred += 1
        else:
            copy_s.append(0.0)
    return exposed_install_s(copy_s, [forward_s * r * c / total for r, c, _ in mats])


# ------------------------------------------------------------------------ the Python thread
# Operators step() dispatches, as written (benchmarks/step_operators.py counts them, outside the
# compiled kernels and the worker's commands, on 8x8 matrices at 64 and 226 of them, U=4;
# tests/test_estimate_terms.py holds these to its count): in a step inside a window, a fixed part
# and a part per matrix by where its sum is (its selected columns' two gathers and scatter, and on
# the host its staging copy; "factored" none more since its weights' view is made once); and per
# window (its end and the steps after it that finish installs), a fixed part and a part per
# matrix by where its sum is (one fewer since a window end writes an installed matrix's columns
# once: 5, 8, 18 before; two and six fewer since the host's views a window end copies into are
# made once: 7 and 17 before; "factored" 11 before its matrices' fingerprints were read once
# fewer at a window's end and at its first step). A model's matrices, each too large to stack:
# alike small ones (an MoE's experts, up to 64K values each) share launches
# (optim/device_adam.py ColumnBlock), which the counts here leave out.
STEP_OPERATORS = 29
STEP_OPERATORS_PER_MATRIX = {"host": 4, "device": 3}
STEP_OPERATORS_PER_FACTORED = 0
WINDOW_OPERATORS = 25
WINDOW_OPERATORS_PER_MATRIX = {"host": 4, "device": 5, "factored": 9}


def python_step_s(c: Counts, s: Speeds, batch: int) -> float:
    """The training thread's time in a step() inside a window: its operators, and the compiled
    "factored" kernels' calls (a step's runs of `batch` matrices and the rest a call each,
    host/credit_factored.py fused_step). On a GPU it hides behind the device's step only while
    shorter; beyond, the step is CPU-bound."""
    operators = (STEP_OPERATORS
                 + STEP_OPERATORS_PER_MATRIX["host"] * (c.matrices - c.device_summed_matrices)
                 + STEP_OPERATORS_PER_MATRIX["device"] * c.device_summed_matrices
                 + STEP_OPERATORS_PER_FACTORED * c.factored_matrices)
    n = c.factored_matrices if c.fused_factored else 0
    return operators * s.operator + (n // batch + n % batch) * s.compiled_call


def python_window_s(c: Counts, s: Speeds, batch: int) -> float:
    """... and per window: its end's operators and those of the steps after it that finish
    installs, and an install's corrections (compiled, in runs of `batch` "factored" matrices;
    per-layer installs make a run of each layer's, about as few calls)."""
    plain = c.device_summed_matrices - c.factored_matrices
    operators = (WINDOW_OPERATORS
                 + WINDOW_OPERATORS_PER_MATRIX["host"] * (c.matrices - c.device_summed_matrices)
                 + WINDOW_OPERATORS_PER_MATRIX["device"] * plain
                 + WINDOW_OPERATORS_PER_MATRIX["factored"] * c.factored_matrices)
    corrections = -(-c.factored_matrices // batch) if c.fused_factored else 0
    return operators * s.operator + corrections * s.compiled_call
