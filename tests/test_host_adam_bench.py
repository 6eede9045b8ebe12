"""benchmarks/host_adam.py on a tiny size: every variant timed beside its probe on each core
count, the ratios and per-core rates written to the JSON it names (nothing measured: too small)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "host_adam.py"


@pytest.mark.slow
def test_host_adam_reports_update_against_probe_per_core_count(tmp_path):
    out = tmp_path / "host_adam.json"
    cores = "1,2" if len(os.sched_getaffinity(0)) > 1 else "1"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--cores", cores, "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] and result["tiny"] is True
    assert [run["cores"] for run in result["runs"]] == [int(c) for c in cores.split(",")]
    for run in result["runs"]:
        assert run["torch_threads"] == run["cores"] == len(run["cpus"])
        for variant in ("mean", "lookahead", "moments"):
            assert run[variant]["ratio_update_to_probe"] > 0
            assert run[variant]["update_params_per_s_per_core"] > 0
            assert {f"zenflow_{variant}", f"probe_{variant}"} <= set(run["systems"])


def test_host_adam_refuses_a_core_count_it_does_not_have(tmp_path):
    too_many = len(os.sched_getaffinity(0)) + 1
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--cores", str(too_many),
                             "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert f"--cores: each count must be between 1 and the {too_many - 1} CPUs" in result.stderr
    assert f"got '{too_many}'" in result.stderr
