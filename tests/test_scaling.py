"""benchmarks/scaling.py on a tiny setting: DDP and FSDP2 rows for 1 and 2 ranks, bytes per
rank from the optimizer's counters (nothing timed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "scaling.py"


@pytest.mark.slow
def test_scaling_reports_fsdp2_rows_beside_ddp(tmp_path):
    out = tmp_path / "scaling"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), "--n-layer", "1", "--n-embd", "32",
                    "--n-head", "2", "--vocab-size", "64", "--steps", "4", "--ranks", "1", "2",
                    "--out", str(out)], check=True, env=env, timeout=300, capture_output=True)
    result = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["layout"], r["world_size"]): r for r in result["runs"]}
    assert set(runs) == {("ddp", 1), ("ddp", 2), ("fsdp2", 1), ("fsdp2", 2)}
    one, ddp, fsdp = runs[("ddp", 1)], runs[("ddp", 2)], runs[("fsdp2", 2)]
    assert runs[("fsdp2", 1)]["host_bytes_per_rank"] == one["host_bytes_per_rank"]
    # Replicas hold the whole model on every rank; shards split it, summing to one process's.
    assert ddp["device_weight_bytes_per_rank"] == one["device_weight_bytes_per_rank"] * 2
    assert sum(fsdp["device_weight_bytes_per_rank"]) == one["device_weight_bytes_per_rank"][0]
    assert sum(fsdp["device_state_bytes_per_rank"]) < sum(ddp["device_state_bytes_per_rank"])
    assert ddp["device_state_bytes_per_rank"][0] == one["device_state_bytes_per_rank"][0]
    # The host side is split by rows either way, the same rows.
    assert fsdp["host_bytes_per_rank"] == ddp["host_bytes_per_rank"]
    # (each rank's staging slot also holds its step's 4-byte factor)
    assert sum(fsdp["host_bytes_per_rank"]) == one["host_bytes_per_rank"][0] + 4
    assert fsdp["d2h_bytes_per_step_per_rank"] == ddp["d2h_bytes_per_step_per_rank"]
    # Installs: FSDP2 writes only its rows; DDP on gloo copies whole matrices to each replica.
    assert sum(fsdp["h2d_bytes_per_window_per_rank"]) == pytest.approx(
        one["h2d_bytes_per_window_per_rank"][0])
    assert "installing host rows" not in json.dumps(fsdp["collective_bytes_per_step"])
    assert out.with_suffix(".png").is_file()
