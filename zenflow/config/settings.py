"""ZenFlow's settings: one validated object with one set of defaults.

`ZenFlowSettings` holds the knobs of ZenFlowAdamW, which reads them from `self.settings` and
nowhere else. The constructor builds it from its keyword arguments (`from_arguments`), the
DeepSpeed JSON config from `zero_optimization.zenflow` (`ZenFlowConfig.zenflow_settings()`, which
zenflow.initialize and `zenflow finetune --config` build their optimizer from); fine-tuning and
the benchmark hand their options to the constructor. Each value is checked by its rule in
`zenflow.config.rules`, the same rule for every entry point; a broken one raises a TypeError or
ValueError that names the argument, the value and what is allowed.

`AdamWHyperparameters` is the same for the AdamW numbers of a param group (torch.optim.AdamW's
defaults), which torch keeps per group and reads at each step.

To add an option: declare it below with its rule type and default, and say in a comment what
it does; add the keyword to `ZenFlowAdamW.__init__` with the default `DEFAULTS.<name>` and pass
it on to `from_arguments` (tests/test_settings.py checks that the constructor lists exactly these
fields, with their defaults and types); read it in the optimizer as `self.settings.<name>`. If
DeepSpeed's JSON block should accept it too, add the key to `ZenFlowSection` in
zenflow/config/zero_sections.py. Torch-free, like the config.

`check_torch_adamw_flags` and `refuse_unknown_keywords` are the constructors' answers to arguments
that are not knobs: torch.optim.AdamW's flags, and names that are not arguments at all.
"""
from __future__ import annotations

import difflib
import inspect

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from zenflow.config.rules import (
    ERROR_TYPE,
    Betas,
    DeferredCredit,
    DeviceSumBudget,
    Eps,
    Flag,
    Fraction,
    Importance,
    IntervalBounds,
    LearningRate,
    Lookahead,
    MomentsDtype,
    NonNegInt,
    PosInt,
    Positive,
    SelectInterval,
    SelectStrategy,
    SumDtype,
    UpdateInterval,
    WeightDecay,
    select_interval_fits_strategy,
)


def _name(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f"{'.' if i else ''}{p}"
                   for i, p in enumerate(loc))


def argument_error(owner: str, exc: ValidationError) -> Exception:
    """The first problem of `exc` as the exception a Python caller expects: a TypeError for a
    value of the wrong type (or an unknown argument), a ValueError for a wrong value."""
    err = exc.errors()[0]
    name = _name(err["loc"])
    if err["type"] == ERROR_TYPE:
        ctx = err["ctx"]
        kind = TypeError if ctx["type_error"] else ValueError
        return kind(f"{owner}: {name}{ctx['where']} {ctx['python']}")
    if err["type"] == "extra_forbidden":
        return TypeError(f"{owner}: {name} is not one of its settings")
    return ValueError(f"{owner}: {name}: {err['msg']}")


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def from_arguments(cls, owner: str, **arguments):
        """Validate keyword arguments of `owner` (a class name, said first in every error)."""
        try:
            return cls.model_validate(arguments)
        except ValidationError as exc:
            raise argument_error(owner, exc) from None

    def replace(self, **changes):
        """A copy with `changes`, validated."""
        return self.from_arguments(type(self).__name__, **{**self.model_dump(), **changes})


class AdamWHyperparameters(_Arguments):
    """The AdamW numbers of one param group, with torch.optim.AdamW's defaults."""

    lr: LearningRate = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: Eps = 1e-8
    weight_decay: WeightDecay = 1e-2


class ZenFlowSettings(_Arguments):
    """The knobs of ZenFlowAdamW (docs/semantics.md says what each one means for a step)."""

    # Fraction of each matrix's columns (input channels) updated on the device every step.
    topk_ratio: Fraction = 0.1
    # When to choose the columns again (zenflow/optim/selection_schedule.py):
    #   "step"   every `select_interval` steps: at each step that is a multiple of it;
    #   "epoch"  every `select_interval` epochs of `steps_per_epoch` steps;
    #   "auto"   DeepSpeed's "auto": once per epoch (= "epoch" with select_interval 1);
    #   "drift"  ours: when the selected columns hold less than `reselect_threshold` of the
    #            importance the best columns would hold (the constructor's default: a bare
    #            optimizer knows no epoch length).
    # "epoch" and "auto" without `steps_per_epoch` select once and keep the columns, with a
    # warning, as DeepSpeed does without a dataloader.
    select_strategy: SelectStrategy = "drift"
    # Steps or epochs between reselections for "step" and "epoch"; "auto" for "auto" and
    # "drift" (DeepSpeed refuses the other pairs too; `select_interval_for` says why).
    select_interval: SelectInterval = "auto"
    # Steps per host window, or "auto": with overlap_step, end a window as soon as the host has
    # finished the previous one's update (and, with `auto_ratio`, once the deferred columns'
    # summed gradient reaches one important step), within `auto_update_bounds`
    # (zenflow/optim/windows.py). Measured on a fine-tune (benchmarks/finetune_quality.py): a window's
    # delay and its single host step both cost quality, so the default makes windows as short as
    # the host keeps up with, which never stalls; a slow host gets longer windows, up to 16 steps.
    update_interval: UpdateInterval = "auto"
    # Initial steps that update every parameter fully, on the host.
    full_warm_up_rounds: NonNegInt = 0
    # Install each window's host update one window later, hiding the host's work.
    overlap_step: Flag = True
    # Clip gradients to this global L2 norm inside step() (None: no clipping).
    max_grad_norm: Positive | None = None
    # Column importance: "l2" or "l1" norm of the column's gradient.
    importance: Importance = "l2"
    # How a window's host step credits the deferred columns: "mean" (ZenFlow's and DeepSpeed's),
    # one AdamW step on the window's mean gradient; "window", the same step at the learning rate
    # times the gradients the window summed, so they move about as far as AdamW would have.
    # Measured on a fine-tune (benchmarks/finetune_quality.py): "window" closes most of the gap
    # to AdamW with overlap_step=False; with the one-window-stale installs of overlap_step=True
    # its larger steps overshoot unless windows are short.
    # "moments", for the matrices whose window sums are on the device with room for their squares
    # and rates (`device_sum_budget` holds every sum first; the others take "mean"): the host's
    # moments take the window as n AdamW steps would (from the window's sum and its sum of
    # squares), the value moves n steps' worth; between installs the device moves the deferred
    # columns every step by a momentum-free step at the host's last per-parameter rate, and an
    # install corrects the host's values with such a step for each gradient the host has not
    # yet applied. Costs 4 more bytes of device memory per summed parameter (the squares) and
    # the rates (2 bytes; 4 for fp32 weights), two fused launches per step, the squares down and
    # the rates up per window. Measured within 0.75% of AdamW at 4-step windows and 1.2% at 8,
    # where "mean" is 4.9% and 6.1% off; at one-step windows 1.05% where "mean" is 0.35%
    # (benchmarks/README.md, "The windows a GPU runs"). "factored" (the default): "moments" with
    # the squares kept as their row and column sums and the rates as row x column factors (8 rows
    # + 12 cols bytes per matrix beside its sum, which may be bf16: ~2 bytes per parameter in
    # all, so it applies where "moments" does not fit); with bf16 weights and sums within 0.94% of
    # fp32-master AdamW at 4-step windows and 1.24% at 8 (benchmarks/README.md, "bf16 weights").
    # On several ranks each rank fits its own row block's factors (FSDP2's shard, DDP's share of
    # the replica's rows: a finer fit than one of the whole matrix); under DDP "moments" takes
    # "mean".
    deferred_credit: DeferredCredit = "factored"
    # Install the deferred columns this fraction of the next host step ahead of the host's
    # values (0: the values). With overlap_step=True the device computes its gradients on
    # weights that miss the update in flight; leading them by the step the moments predict
    # makes those gradients less stale. The host's values stay exact: synchronize() installs
    # them and state_dict() holds them. Matrices under deferred_credit "moments" do not lead:
    # the device's interim steps answer the delay there.
    # Only updates installed one window later (overlap_step=True, after warm-up) lead; the
    # default 1.0 removes most of what a one-step delay costs (measured: +1.6% -> +0.3% held-out
    # loss against AdamW on the fine-tune).
    install_lookahead: Lookahead = 1.0
    # Steps per epoch, for select_strategy="epoch" (the engine takes it from its dataloader).
    steps_per_epoch: PosInt | None = None
    # Share of this rank's cores left to the training process, DeepSpeed's way (0..1: it keeps
    # ceil(perc * cores)); the host worker gets the rest. None (the default): the training
    # process keeps 2 physical cores (its Python thread and autograd's device thread) and the
    # worker takes every other core of the rank's share, on every socket, where the host
    # AdamW's memory bandwidth is (zenflow/host/cores.py). DeepSpeed's default, 0.5, gives the
    # worker one socket of a two-socket server: its windows are then about twice as long.
    pt_reserved_cores_perc: Fraction | None = None
    # Retained-importance fraction under which select_interval="auto" reselects. One step's
    # gradient is noisy: a few steps after a fresh selection the selected columns hold 0.66-0.81
    # of the best columns' importance when nothing has drifted (measured: MiniLM fine-tuned on
    # BBC News, batch 16; a GPT from scratch), so 0.6 fires on drift, not on noise.
    reselect_threshold: Fraction = 0.6
    # The update_interval="auto" importance threshold (DeepSpeed's key; its default, 0.99, is the
    # JSON block's; 0..1 as DeepSpeed's, where 0 ends each window as soon as the bounds and the
    # host allow), or None: no importance threshold, the host's speed alone ends windows.
    auto_ratio: Fraction | None = None
    # (min, max) window length for update_interval="auto".
    auto_update_bounds: IntervalBounds = (1, 16)
    # Device memory for the window's gradient sums of host-owned rows, in bytes (4 per summed
    # parameter). A matrix summed on the device crosses the bus once per window, as its fp32 sum,
    # and costs the host nothing per step; the others cross every step and the worker sums them.
    # 0: every sum on the host. "auto": what the device has left after the first step's forward
    # and backward (its peak so far), less a headroom of a tenth of its memory; on a CPU "device",
    # where the worker adds in parallel with training, 0. Every sum it can hold comes first; what
    # is left holds the squares and rates of deferred_credit "moments" (8 bytes, 6 for 16-bit
    # weights), for as many of the summed matrices as fit.
    device_sum_budget: DeviceSumBudget = "auto"
    # The dtype of the window sums kept on the device. "bfloat16" halves their device memory (2
    # bytes per summed parameter: the budget holds twice as many) and their bytes over the bus,
    # at the cost of rounding the running sum to bf16 after each step's add (a relative error of
    # about 2**-9 per step, where the fp32 sum equals the host's bit for bit); the host widens
    # it to fp32 in place before its AdamW. Matrices under deferred_credit "moments" keep fp32
    # sums: their interim steps and install corrections read the sum. "auto" (the default):
    # "bfloat16" where every matrix is bf16 (the gradients summed are bf16 already: the sum
    # rounds as they did, and the default "factored" then fits in 2 bytes a parameter, as
    # measured), else "float32".
    device_sum_dtype: SumDtype = "auto"
    # The dtype of Adam's two moments in host memory. "bfloat16" keeps them in 2 bytes each
    # instead of 4: 4 bytes less host memory per parameter (Llama-2-7B: 27 GB) and 8 fewer of
    # the ~28 bytes a host update moves per parameter, so windows shorten where the host is
    # memory-bound. The arithmetic stays fp32 (the moments are widened a chunk at a time) and
    # they are rounded back stochastically, with random bits taken from the new master value
    # (reproducible: no generator state), so the second moment keeps following the gradients'
    # scale where rounding to nearest would stall it (zenflow/host/compact_moments.py). The
    # master values stay fp32, the device's columns fp32, and a saved state holds fp32 moments
    # (loadable under either setting). Measured on the bf16 fine-tune: benchmarks/README.md,
    # "Compact host moments".
    host_moments_dtype: MomentsDtype = "float32"
    # Run the host side in a worker process (False: in the training process, synchronously;
    # for debugging and for machines without a spare core).
    worker: Flag = True

    _fits_the_strategy = field_validator("select_interval")(select_interval_fits_strategy)


DEFAULTS = ZenFlowSettings()
ADAMW_DEFAULTS = AdamWHyperparameters()


# torch.optim.AdamW's flags that the constructors accept so that a torch user's call runs as
# written. Those that choose an implementation change nothing here: the device update always
# runs torch's fused AdamW kernel where the device has one (foreach ops elsewhere), and the host
# runs its own.
IGNORED_TORCH_FLAGS = ("foreach", "fused")
# Those that change the arithmetic are honoured where False (torch's default) and refused
# otherwise, with the reason.
UNSUPPORTED_TORCH_FLAGS = {
    "amsgrad": "neither the host's AdamW nor the device's keeps the running maximum of the second "
               "moment (it would be one more fp32 state per parameter on each side)",
    "maximize": "every update descends the gradient; to maximize an objective, minimize its "
                "negative",
    "capturable": "step() hands work to a host worker and reads its results, which a CUDA graph "
                  "cannot capture",
    "differentiable": "the host's update runs outside autograd (in a worker process by default)",
}


def check_torch_adamw_flags(owner: str, **flags) -> None:
    """Refuse torch.optim.AdamW flags `owner` cannot honour (see UNSUPPORTED_TORCH_FLAGS); check
    that the ignored ones are what torch accepts (True, False or None)."""
    for name, value in flags.items():
        if name in IGNORED_TORCH_FLAGS:
            if value not in (None, True, False):
                raise TypeError(f"{owner}: {name} must be True, False or None (as in "
                                f"torch.optim.AdamW; it changes nothing here), got {value!r:.100}")
        elif value is not False:
            if value is not True:
                raise TypeError(f"{owner}: {name} must be False (torch.optim.AdamW's default; "
                                f"True is not supported here), got {value!r:.100}")
            raise ValueError(f"{owner}: {name}=True is not supported: "
                             f"{UNSUPPORTED_TORCH_FLAGS[name]}; pass {name}=False or leave it out")


def refuse_unknown_keywords(owner: str, init, kwargs: dict) -> None:
    """Raise unknown_keyword_error for the first of `kwargs` that `init` (a constructor) does not
    take, before Python would (its TypeError says only "unexpected keyword argument")."""
    arguments = [name for name in inspect.signature(init).parameters if name != "self"]
    for name, value in kwargs.items():
        if name not in arguments:
            raise unknown_keyword_error(owner, name, value, arguments)


def unknown_keyword_error(owner: str, name: str, value, arguments: list[str]) -> TypeError:
    """The error for a keyword `owner` does not take: the closest of its `arguments`, or, for a
    ZenFlow knob that this optimizer has fixed (OffloadAdamW's), why it is not one."""
    if name in ZenFlowSettings.model_fields:
        return TypeError(f"{owner}: {name}={value!r:.100} is not one of its arguments: {owner} "
                         f"fixes that ZenFlow knob (ZenFlowAdamW takes it); its arguments: "
                         f"{', '.join(arguments)}")
    close = difflib.get_close_matches(name, arguments, n=1)
    hint = (f"did you mean {close[0]}?" if close else
            f"its arguments: {', '.join(arguments)}")
    return TypeError(f"{owner}: {name}={value!r:.100} is not one of its arguments; {hint} "
                     "(docs/knobs.md lists every knob)")
