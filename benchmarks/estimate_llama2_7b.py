"""`zenflow estimate` on Llama-2-7B, bf16, one H100 and four A100s: the table of
benchmarks/README.md ("zenflow estimate: Llama-2-7B on GPUs"), from the model of the code as it
is. No GPU runs here: the figures are a 2-socket server's and the GPUs' datasheet bandwidths
(`FIGURES`), and forward+backward is given (`FWD_BWD_S`). Each configuration twice: the step
waiting for the whole install, and per-layer installs (the model attached to the optimizer).

    python benchmarks/estimate_llama2_7b.py     # writes results/estimate_llama2_7b_gpu.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zenflow.tools.estimate import estimate
from zenflow.tools.estimate_shapes import llama_shapes

# host accumulate 2e10 and host AdamW 5.2e9 parameters/s over both sockets; PCIe Gen5 (H100) and
# Gen4 (A100) each way; the GPUs' HBM as the device's copy and AdamW speed
_HOST = dict(host_adamw_params_per_s=5.2e9, host_accumulate_params_per_s=2e10,
             gpu_memory_bytes=80 * 2**30, device="cuda:0")
FIGURES = {
    "1xH100": dict(_HOST, device_adamw_params_per_s=1.2e11, device_norm_bytes_per_s=2.5e12,
                   device_copy_bytes_per_s=1.5e12, d2h_bytes_per_s=5e10, h2d_bytes_per_s=5e10),
    "4xA100": dict(_HOST, device_adamw_params_per_s=7e10, device_norm_bytes_per_s=1.5e12,
                   device_copy_bytes_per_s=1e12, d2h_bytes_per_s=2.4e10, h2d_bytes_per_s=2.4e10),
}
FWD_BWD_S = {"1xH100": 0.5, "4xA100": 0.45}
GPUS = {"1xH100": 1, "4xA100": 4}
# (row name, estimate() settings): the host sums, "mean" with the sums on the device, the defaults
SYSTEMS = {
    "host sums (device_sum_budget=0)": dict(device_sum_budget=0),
    "sums on the device, deferred_credit 'mean'": dict(deferred_credit="mean"),
    "bf16 sums on the device, 'mean'": dict(deferred_credit="mean",
                                            device_sum_dtype="bfloat16"),
    "defaults (every sum on the device, 'factored')": {},
}


def rows() -> list[dict]:
    shapes = llama_shapes(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32)
    out = []
    # installs: "whole" (the step waits for the whole copy), "per layer" (the model attached)
    cases = [(config, name, installs) for config in FIGURES for name in SYSTEMS
             for installs in ("whole", "per layer")]
    for config, name, installs in cases:
        r = estimate(shapes, torch.bfloat16, gpus=GPUS[config], topk_ratio=0.1,
                     update_interval="auto", overlap=True, fwd_bwd_s=FWD_BWD_S[config],
                     measured=FIGURES[config], source="Llama-2-7B",
                     attached=installs == "per layer", **SYSTEMS[name])
        t, g, b = r["time"], r["per_gpu"], r["bus"]["zenflow"]
        out.append({
            "config": config, "system": name, "installs": installs,
            "U": r["settings"]["update_interval"],
            "zenflow_step_s": t["zenflow_step_s"], "floor_s": t["adamw_step_s"],
            "vs_floor": t["zenflow_vs_floor"],
            "python_s": t["zenflow_python_s"], "cpu_bound_risk": t["cpu_bound_risk"],
            "stall_share": t["zenflow_stall_s"] / t["zenflow_step_s"],
            "install_wait_s": r["seconds"]["install_wait_s"],
            "bus_per_step_vs_model": (b["d2h_bytes_per_step"] + b["h2d_bytes_per_step"])
            / b["model_bytes"],
            "vs_offload": t["speedup_vs_offload"],
            "device_sum_matrices": g["device_sum_matrices"],
            "moments_matrices": g["moments_matrices"],
            "device_sum_gib": g["device_sum_bytes"] / 2**30,
            "quality_gap_pct": r["quality"]["held_out_loss_gap_pct"],
            "moments_share": r["quality"]["moments_share"]})
    return out


def main() -> int:
    table = rows()
    out = Path(__file__).resolve().parent / "results" / "estimate_llama2_7b_gpu.json"
    out.write_text(json.dumps({"machine": "model only (zenflow estimate), no GPU",
                               "figures": FIGURES, "fwd_bwd_s": FWD_BWD_S, "rows": table},
                              indent=1))
    for r in table:
        print(f"{r['config']:7s} {r['system']:58s} {r['installs']:9s} U={r['U']:2d} "
              f"{r['zenflow_step_s']:.3f} s "
              f"{r['vs_floor']:.2f}x floor, install wait {r['install_wait_s']:.3f} s, "
              f"stall {100 * r['stall_share']:.1f}%, bus "
              f"{r['bus_per_step_vs_model']:.2f}x, {r['vs_offload']:.2f}x offload, sums on the "
              f"device {r['device_sum_matrices']} ({r['moments_matrices']} 'moments', "
              f"{r['device_sum_gib']:.1f} GiB), quality {r['quality_gap_pct']:+.1f}%")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
