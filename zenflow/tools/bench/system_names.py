"""The systems `zenflow bench` compares, by name: plain data, apart from their runners
(systems.py, which imports torch), so that the command's --help needs no torch."""
from __future__ import annotations

# name -> (label, needs DeepSpeed). Order is the default order of a round.
SYSTEMS: dict[str, tuple[str, bool]] = {
    "adamw": ("AdamW (no offload)", False),
    "offload": ("zenflow OffloadAdamW", False),
    "zenflow-sync": ("zenflow ZenFlowAdamW, overlap off", False),
    "zenflow": ("zenflow ZenFlowAdamW, overlap on", False),
    "zenflow-defaults": ("zenflow ZenFlowAdamW, its own defaults (host-paced windows)", False),
    "zenflow-moments": ("zenflow ZenFlowAdamW, overlap on, every window sum on the device "
                        "(deferred_credit 'moments')", False),
    "ds-offload": ("DeepSpeed ZeRO-Offload (stage 2)", True),
    "ds-zenflow": ("DeepSpeed ZenFlow (stage 2)", True),
}
