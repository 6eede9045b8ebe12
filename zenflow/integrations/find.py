"""The ZenFlow optimizers behind the frameworks' wrappers (Accelerate, Lightning, the HF Trainer,
our engine), and installing their in-flight host updates."""
from __future__ import annotations

from typing import Any

# Attributes through which frameworks hold the optimizer they wrap: Accelerate's
# AcceleratedOptimizer and HF Trainer (.optimizer), Lightning's LightningOptimizer (._optimizer),
# Lightning's Trainer (.optimizers), a LightningModule (.trainer), our engine (.optimizer).
_WRAPPER_ATTRIBUTES = ("optimizer", "_optimizer", "optimizers", "trainer")
_MAX_DEPTH = 4


def _zenflow_classes() -> tuple[type, ...]:
    from zenflow.optim.offload import OffloadAdamW
    from zenflow.optim.optimizer import ZenFlowAdamW
    return ZenFlowAdamW, OffloadAdamW


def _attribute(obj: Any, name: str) -> Any:
    # A LightningModule's .trainer and .optimizers() raise when no trainer is attached.
    try:
        value = getattr(obj, name, None)
        if name == "optimizers" and callable(value):
            value = value()  # LightningModule.optimizers() is a method, Trainer's a property
    except Exception:
        return None
    return value


def find_optimizers(obj: Any) -> list:
    """Every ZenFlowAdamW/OffloadAdamW reachable from `obj` through framework wrappers (itself
    included), each once, in the order found."""
    classes = _zenflow_classes()
    found: list = []
    seen: set[int] = set()

    def visit(item: Any, depth: int) -> None:
        if item is None or id(item) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(item))
        if isinstance(item, classes):
            # Lightning's LightningOptimizer is a dynamic subclass of the optimizer it wraps
            # (held in ._optimizer): report the real one.
            inner = _attribute(item, "_optimizer")
            if isinstance(inner, classes) and inner is not item:
                visit(inner, depth + 1)
            elif id(item) not in {id(f) for f in found}:
                found.append(item)
            return
        if isinstance(item, (list, tuple)):
            for sub in item:
                visit(sub, depth + 1)
            return
        if isinstance(item, (str, bytes, int, float, dict)):
            return
        for name in _WRAPPER_ATTRIBUTES:
            visit(_attribute(item, name), depth + 1)

    visit(obj, 0)
    return found


def find_optimizer(obj: Any):
    """The one ZenFlowAdamW/OffloadAdamW inside `obj` (an optimizer, Accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer/Trainer/LightningModule, an HF Trainer,
    a zenflow engine). Raises ValueError when there is none or more than one."""
    found = find_optimizers(obj)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ValueError(f"find_optimizer: {what} ZenFlowAdamW/OffloadAdamW found in a "
                         f"{type(obj).__name__} (looked through "
                         f"{', '.join('.' + a for a in _WRAPPER_ATTRIBUTES)}); "
                         + ("pass the optimizer or the object holding it" if not found else
                            "use find_optimizers() to get them all"))
    return found[0]


def synchronize(obj: Any) -> int:
    """Install the in-flight host update of every ZenFlow optimizer inside `obj`; returns how many
    optimizers it found (0 is fine: nothing to install)."""
    found = find_optimizers(obj)
    for optimizer in found:
        optimizer.synchronize()
    return len(found)
