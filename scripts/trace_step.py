"""Trace one window-ending step() of ZenFlowAdamW: which modules and functions of the package it
runs through, and how often a lower part calls back up into the optimizer (zenflow/optim/
optimizer.py). A newcomer reading one step follows these; fewer is easier.

    .venv/bin/python scripts/trace_step.py [--json FILE]

The model is Llama-2-7B's 226 matrices at a narrow width; the traced step is the second window's
end (an install of the first window's update, and a hand-off of its own), without attach() (every
install finished in the step) and with it, as the engine and the framework callbacks run it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import zenflow

PACKAGE = os.path.dirname(os.path.abspath(zenflow.__file__))
OPTIMIZER = os.path.join(PACKAGE, "optim", "optimizer.py")


def _model() -> torch.nn.Module:
    layers = []
    for _ in range(32):
        layers += [torch.nn.Linear(32, 32, bias=False) for _ in range(4)]
        layers += [torch.nn.Linear(32, 86, bias=False), torch.nn.Linear(86, 32, bias=False),
                   torch.nn.Linear(32, 32, bias=False)]
    layers += [torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False)]
    return torch.nn.ModuleList(layers)


def _backward(model: torch.nn.ModuleList) -> None:
    x = torch.randn(2, 32)
    loss = sum(layer(x if layer.in_features == 32 else torch.randn(2, layer.in_features)).sum()
               for layer in model)
    loss.backward()


def trace(attach: bool, update_interval: int = 2) -> dict:
    torch.manual_seed(0)
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1,
                               update_interval=update_interval, worker=False,
                               select_strategy="step", select_interval=1000)
    if attach:
        opt.attach(model)
    for _ in range(2 * update_interval - 1):
        _backward(model)
        opt.step()
        opt.zero_grad()
    _backward(model)
    calls: list[tuple[str, str, str]] = []   # (caller file, callee file, callee function)

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGE):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        calls.append((caller, callee, frame.f_code.co_qualname))
    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    opt.close()
    modules = sorted({os.path.relpath(callee, PACKAGE) for _, callee, _ in calls})
    functions = sorted({(os.path.relpath(callee, PACKAGE), name) for _, callee, name in calls})
    back_up = sorted({f"{os.path.relpath(caller, PACKAGE)} -> {name}"
                      for caller, callee, name in calls
                      if callee == OPTIMIZER and caller.startswith(PACKAGE)
                      and caller != OPTIMIZER})
    return {"modules": modules, "functions": len(functions), "calls_back_up": back_up}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the trace there")
    args = parser.parse_args()
    results = {}
    for attach in (False, True):
        result = results["attached" if attach else "not attached"] = trace(attach)
        print(f"{'with' if attach else 'without'} attach(): {len(result['modules'])} modules, "
              f"{result['functions']} functions, {len(result['calls_back_up'])} calls back up "
              "into the optimizer")
        print("  ", " ".join(result["modules"]))
        for call in result["calls_back_up"]:
            print("   back up:", call)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
