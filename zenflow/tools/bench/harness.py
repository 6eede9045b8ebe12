"""Rounds of child processes, and the machine they ran on (zenflow/tools/bench/report.py holds
the statistics, ratios, targets and the terminal table of the report).

Each (round, system) pair runs in a fresh child process started one after another, so machine
drift hits every system alike, host memory high-water marks are clean per system, and a crash in
one system (DeepSpeed, say) is recorded without stopping the others. The order of systems is
rotated every round so no system always runs first after a cold start.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from zenflow.tools.bench.report import check_targets, describe, speed_ratios, summarise
from zenflow.tools.bench.systems import PROGRESS_PREFIX, SYSTEMS, system_unavailable_reason


def machine_info(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # other jobs sharing the machine
        # glibc's malloc settings change every system's step time (freed gradient memory handed
        # back to the OS is page-faulted in again next step): every child runs with these.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    import torch
    info["torch"] = torch.__version__
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        from importlib.metadata import version
        info["deepspeed"] = version("deepspeed")
    except Exception:
        info["deepspeed"] = None
    return info


def slug(text: str) -> str:
    """`text` as part of a file name: lowercase letters and digits, any run of others one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_tag(info: dict[str, Any]) -> str:
    """A results file's machine part, from machine_info(): its CPU and the cores it had."""
    return f"{slug(info['cpu'])}-{info['cores_available']}cpu"


def write_json(result: dict, path: str) -> str:
    """`result` as JSON at `path` (its folder made), said on stdout; returns `path`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path


def _run_child(spec: dict, timeout_s: float, on_progress: Callable[[dict], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="zenflow-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        if spec["device"] == "cpu":
            env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("PYTHONUNBUFFERED", "1")
        log_tail: deque[str] = deque(maxlen=40)
        started = time.perf_counter()
        # Other work on the machine shows up here; recorded so a noisy run can be recognised.
        load_before = os.getloadavg()[0]
        proc = subprocess.Popen([sys.executable, "-m", "zenflow.tools.bench.systems", spec_path, out_path],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        timed_out = False
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS_PREFIX):
                try:
                    on_progress(json.loads(line[len(PROGRESS_PREFIX):]))
                except json.JSONDecodeError:
                    pass
            else:
                log_tail.append(line.rstrip())
            if time.perf_counter() - started > timeout_s:
                timed_out = True
                proc.kill()
                break
        try:
            proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        wall = time.perf_counter() - started
        result: dict[str, Any]
        if os.path.exists(out_path):
            with open(out_path) as f:
                result = json.load(f)
        else:
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit status {proc.returncode}"
            result = {"system": spec["system"], "ok": False, "error": f"child process died ({why})"}
        result["child_wall_s"] = wall
        result["loadavg_before_after"] = [load_before, os.getloadavg()[0]]
        if not result.get("ok"):
            result["log_tail"] = list(log_tail)
        return result


class Progress:
    """Progress on the terminal: a live line on a TTY, one line per finished child otherwise."""

    def __init__(self, out: TextIO, total_children: int) -> None:
        self.out, self.total, self.done = out, total_children, 0
        self.tty = out.isatty()
        self.prefix = ""

    def start(self, round_idx: int, rounds: int, system: str) -> None:
        self.prefix = f"[{self.done + 1}/{self.total}] round {round_idx + 1}/{rounds} {system:<13}"
        if self.tty:
            self.out.write(f"\r{self.prefix} starting...\033[K")
            self.out.flush()

    def step(self, p: dict) -> None:
        if self.tty:
            tag = " (warm-up)" if p.get("warmup") else ""
            self.out.write(f"\r{self.prefix} step {p['step']:>3}/{p['total']} "
                           f"loss {p['loss']:.4f} {p['seconds'] * 1e3:8.1f} ms{tag}\033[K")
            self.out.flush()

    def finish(self, result: dict) -> None:
        self.done += 1
        if result.get("ok"):
            med = describe(result["step_s"])["median"] * 1e3
            msg = (f"median step {med:8.1f} ms, final loss {result['losses'][-1]:.4f}, "
                   f"child {result['child_wall_s']:.0f} s")
        else:
            msg = "FAILED: " + result.get("error", "?").splitlines()[0][:150]
        start, clear = ("\r", "\033[K") if self.tty else ("", "")
        self.out.write(f"{start}{self.prefix} {msg}{clear}\n")
        self.out.flush()


def round_order(systems: list[str], r: int) -> list[str]:
    """The systems of round `r`, rotated by `r` so none always runs first."""
    if not systems:
        return []
    k = r % len(systems)
    return systems[k:] + systems[:k]


def run_benchmark(spec: dict, systems: list[str], rounds: int, *, child_timeout_s: float = 900.0,
                  out: TextIO = sys.stdout, title: str = "zenflow bench") -> dict[str, Any]:
    """Run `systems` for `rounds` rounds (each a fresh child process) and summarise; `title`
    names the run in the line that says what will run."""
    for name in systems:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    m = spec["model"]
    out.write(f"{title}: {spec['num_params'] / 1e6:.1f}M params (layers={m['n_layer']}, "
              f"width={m['n_embd']}, vocab={m['vocab_size']}), batch {spec['batch_size']} x "
              f"{m['seq_len']} tokens, {spec['dtype']} on {spec['device']}; {rounds} round(s) of "
              f"{spec['warmup']} warm-up + {spec['steps']} measured steps; systems: "
              f"{', '.join(systems)}\n")
    out.flush()
    started = time.time()
    per_system: dict[str, dict[str, Any]] = {}
    runnable = []
    for name in systems:
        reason = system_unavailable_reason(name)
        per_system[name] = {"label": SYSTEMS[name][0], "available": reason is None, "rounds": []}
        if reason is None:
            runnable.append(name)
        else:
            per_system[name]["error"] = reason
            out.write(f"skipping {name}: {reason}\n")

    progress = Progress(out, rounds * len(runnable))
    failed: set[str] = set()
    for r in range(rounds):
        for name in round_order(runnable, r):
            if name in failed:
                progress.done += 1
                continue
            progress.start(r, rounds, name)
            result = _run_child(dict(spec, system=name), child_timeout_s, progress.step)
            progress.finish(result)
            result["round"] = r
            per_system[name]["rounds"].append(result)
            if not result.get("ok"):
                # Failures here are configuration or build errors, which repeat: record once.
                failed.add(name)
                per_system[name]["error"] = result.get("error")

    for name, entry in per_system.items():
        entry["summary"] = summarise(entry["rounds"], spec)
    report = {
        "benchmark": "zenflow bench",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "machine": machine_info(spec["device"]),
        "config": {k: v for k, v in spec.items() if k != "system"},
        "rounds": rounds,
        "systems": per_system,
    }
    report["ratios"] = speed_ratios(per_system)
    report["targets"] = check_targets(report, spec["device"])
    return report
