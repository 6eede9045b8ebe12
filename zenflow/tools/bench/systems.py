"""One runner per benchmarked system, and the child-process entry point that runs one of them.

Every system trains the same GPT (same seed, same initial weights) on the same token stream with
the same hyper-parameters. A run is described by a plain dict (the *spec*) so that it can be
handed to a fresh child process as JSON: `python -m zenflow.tools.bench.systems SPEC.json OUT.json`.
The child prints `@@progress` lines on stdout for the parent and writes its result as JSON.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from zenflow.tools.bench.model import GPT, GPTConfig, TokenStream
from zenflow.tools.bench.system_names import SYSTEMS as SYSTEMS  # name -> (label, DeepSpeed?)

PROGRESS_PREFIX = "@@progress "


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def system_unavailable_reason(name: str) -> str | None:
    """Why `name` cannot run in this environment, or None when it can."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    if SYSTEMS[name][1] and not deepspeed_available():
        return "deepspeed is not importable (see scripts/install_deepspeed.sh)"
    return None


# ----------------------------------------------------------------------------------------------
# runners: build(model, spec) -> runner with .train_step(x, y, sync) -> (loss, phases), .stats(),
# .close(). `phases` is a dict of seconds: forward, backward, step.


class _TorchOptimizerRunner:
    """A plain loop around a torch.optim.Optimizer (AdamW, or one of ours)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def train_step(self, x, y, sync: Callable[[], None]):
        t0 = time.perf_counter()
        loss = self.model(x, y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        return float(loss.detach()), {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}

    def stats(self) -> dict[str, Any] | None:
        stats = getattr(self.opt, "stats", None)
        return _jsonable(stats()) if callable(stats) else None

    def host_updates(self) -> list[tuple[float, float]]:
        """(start, end) perf_counter seconds of each host update, where the optimizer says."""
        timeline = getattr(self.opt, "timeline", None)
        return [tuple(u) for u in timeline().get("host_updates", [])] if callable(timeline) else []

    def finish(self) -> None:
        # Install any in-flight host update so the final weights are the trained ones.
        sync = getattr(self.opt, "synchronize", None)
        if callable(sync):
            sync()

    def close(self) -> None:
        close = getattr(self.opt, "close", None)
        if callable(close):
            close()


def _adam_kwargs(spec: dict) -> dict:
    return dict(lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                weight_decay=spec["weight_decay"])


def build_adamw(model, spec):
    # The strongest plain baseline: fused AdamW where this torch build supports it on the device.
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = torch.optim.AdamW(params, fused=True, **_adam_kwargs(spec))
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(params, **_adam_kwargs(spec))
    return _TorchOptimizerRunner(model, opt)


def build_offload(model, spec):
    from zenflow import OffloadAdamW
    return _TorchOptimizerRunner(model, OffloadAdamW(model.parameters(), **_adam_kwargs(spec)))


def _build_zenflow(model, spec, overlap: bool):
    # spec["zenflow"] is the zenflow block DeepSpeed's ZenFlow gets too: ZenFlowSettings fields.
    from zenflow import ZenFlowAdamW
    opt = ZenFlowAdamW(model.parameters(), **_adam_kwargs(spec),
                       **dict(spec["zenflow"], overlap_step=overlap))
    return _TorchOptimizerRunner(model, opt)


def build_zenflow_sync(model, spec):
    return _build_zenflow(model, spec, overlap=False)


def build_zenflow(model, spec):
    return _build_zenflow(model, spec, overlap=True)


def build_zenflow_moments(model, spec):
    # The shared block with every window sum on the device, as a GPU with room for them runs it
    # (a CPU "device" gets no budget by default): deferred_credit "moments" on every matrix.
    from zenflow import ZenFlowAdamW
    opt = ZenFlowAdamW(model.parameters(), **_adam_kwargs(spec),
                       **dict(spec["zenflow"], overlap_step=True, deferred_credit="moments",
                              device_sum_budget=1 << 50))
    return _TorchOptimizerRunner(model, opt)


def build_zenflow_defaults(model, spec):
    # Not the shared zenflow block: the package's defaults (update_interval "auto" with no
    # importance threshold, lookahead 1), which DeepSpeed has no equivalent of.
    from zenflow import ZenFlowAdamW
    return _TorchOptimizerRunner(model, ZenFlowAdamW(model.parameters(), **_adam_kwargs(spec)))


class _DeepSpeedRunner:
    def __init__(self, engine) -> None:
        self.engine = engine

    def train_step(self, x, y, sync: Callable[[], None]):
        t0 = time.perf_counter()
        loss = self.engine(x, y)
        sync()
        t1 = time.perf_counter()
        self.engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        self.engine.step()
        sync()
        t3 = time.perf_counter()
        return float(loss.detach()), {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}

    def stats(self) -> None:
        return None

    def host_updates(self) -> list:
        return []

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_config(spec: dict, zenflow: bool) -> dict:
    """The DeepSpeed JSON config for the run, ZeRO stage 2 with the optimizer on the CPU."""
    dtype = spec["dtype"]
    zero: dict[str, Any] = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": spec["device"] == "cuda"},
    }
    if zenflow:
        zero["zenflow"] = dict(spec["zenflow"], overlap_step=True)
    return {
        "train_micro_batch_size_per_gpu": spec["batch_size"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {
            "lr": spec["lr"], "betas": list(spec["betas"]), "eps": spec["eps"],
            "weight_decay": spec["weight_decay"]}},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build_deepspeed(model, spec, zenflow: bool):
    # A single-process "distributed" job, as DeepSpeed expects to be launched by its runner.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo" if spec["device"] == "cpu" else "nccl")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(spec, zenflow))
    return _DeepSpeedRunner(engine)


def build_ds_offload(model, spec):
    return _build_deepspeed(model, spec, zenflow=False)


def build_ds_zenflow(model, spec):
    return _build_deepspeed(model, spec, zenflow=True)


BUILDERS = {
    "adamw": build_adamw,
    "offload": build_offload,
    "zenflow-sync": build_zenflow_sync,
    "zenflow": build_zenflow,
    "zenflow-defaults": build_zenflow_defaults,
    "zenflow-moments": build_zenflow_moments,
    "ds-offload": build_ds_offload,
    "ds-zenflow": build_ds_zenflow,
}


# ----------------------------------------------------------------------------------------------
# the child process


def _jsonable(obj: Any) -> Any:
    """Telemetry dicts as plain JSON values (tensors and numpy scalars become numbers/lists)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


def _maxrss_mb(who: int) -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(who).ru_maxrss / 1024.0


def _descendants_peak_rss_mb() -> dict[int, float]:
    """VmHWM (peak RSS) of every live descendant process, by pid: host-update workers that are
    not our direct, reaped children (a fork server's workers, DeepSpeed's optimizer process)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the command name may contain spaces; the ppid follows its closing paren
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = {}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child in (c for c, pp in parent_of.items() if pp == pid):
            frontier.append(child)
            try:
                with open(f"/proc/{child}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            found[child] = int(line.split()[1]) / 1024.0
            except OSError:
                pass
    return found


def _progress(**fields: Any) -> None:
    print(PROGRESS_PREFIX + json.dumps(fields), flush=True)


def _eval_loss(model, stream: TokenStream, batches: int, device) -> float:
    """Mean loss on held-out batches (step numbers no training step uses), the same for all."""
    with torch.no_grad():
        losses = [float(model(*(t.to(device) for t in stream.batch(10**6 + i))))
                  for i in range(batches)]
    return sum(losses) / len(losses)


def run_system(spec: dict) -> dict:
    """Train `spec["system"]` for warmup + steps and return the measurements."""
    name = spec["system"]
    torch.set_num_threads(spec["main_threads"])
    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    cfg = GPTConfig(**spec["model"])
    model = GPT(cfg).to(device=device, dtype=dtype)
    stream = TokenStream(cfg.vocab_size, cfg.seq_len, spec["batch_size"], seed=spec["seed"])
    result: dict[str, Any] = {"system": name, "num_params": model.num_params(),
                              "rss_after_model_mb": _maxrss_mb(resource.RUSAGE_SELF)}
    # The loss of the weights as given, before any system touches them.
    with torch.no_grad():
        x0, y0 = stream.batch(0)
        result["loss_given_weights"] = float(model(x0.to(device), y0.to(device)))

    t_build = time.perf_counter()
    runner = BUILDERS[name](model, spec)
    result["setup_s"] = time.perf_counter() - t_build
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    total = spec["warmup"] + spec["steps"]
    losses, step_s, phases, timeline, stats_per_step = [], [], [], [], []
    t_origin = time.perf_counter()
    try:
        stats_start = runner.stats()  # replaced after the last warm-up step
        for i in range(total):
            x, y = (t.to(device) for t in stream.batch(i))
            t0 = time.perf_counter()
            loss, ph = runner.train_step(x, y, sync)
            t1 = time.perf_counter()
            losses.append(loss)
            if i + 1 == spec["warmup"]:
                stats_start = runner.stats()
            if i >= spec["warmup"]:
                step_s.append(t1 - t0)
                phases.append(ph)
                if len(timeline) < spec["timeline_steps"]:
                    timeline.append({"start": t0 - t_origin, **ph})
                    stats_per_step.append(runner.stats())
            _progress(system=name, step=i + 1, total=total, loss=loss, seconds=t1 - t0,
                      warmup=i < spec["warmup"])
        # Host updates that overlap the timeline steps, on the timeline's clock (perf_counter is
        # system-wide monotonic on Linux, so a worker process's stamps line up with ours).
        if timeline:
            t_end = timeline[-1]["start"] + sum(timeline[-1][k] for k in ("forward", "backward", "step"))
            result["host_update_spans"] = [
                (a - t_origin, b - t_origin) for a, b in runner.host_updates()
                if b - t_origin >= timeline[0]["start"] and a - t_origin <= t_end]
        # Telemetry over exactly the measured steps: counters at their start and end.
        result["stats_measured"] = {"start": stats_start, "end": runner.stats()}
        runner.finish()
        result["final_stats"] = runner.stats()
        if cuda:
            result["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["eval_loss"] = _eval_loss(model, stream, spec["eval_batches"], device)
        result["descendants_peak_rss_mb"] = _descendants_peak_rss_mb() if os.path.isdir("/proc") else {}
    finally:
        runner.close()
    result.update(losses=losses, step_s=step_s, phases=phases, timeline=timeline,
                  stats_per_step=stats_per_step,
                  rss_peak_mb=_maxrss_mb(resource.RUSAGE_SELF),
                  # Largest descendant, reaped or still alive before close() (e.g. a host-update
                  # worker). Shared-memory pages are counted in both this and rss_peak_mb.
                  rss_peak_children_mb=max([_maxrss_mb(resource.RUSAGE_CHILDREN),
                                            *result.get("descendants_peak_rss_mb", {}).values()]))
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m zenflow.tools.bench.systems SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        result = run_system(spec)
        result["ok"] = True
    except BaseException as exc:  # recorded, so the benchmark goes on with the other systems
        result = {"system": spec.get("system"), "ok": False,
                  "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
