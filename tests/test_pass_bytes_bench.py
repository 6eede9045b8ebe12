"""benchmarks/pass_bytes.py on a tiny size: the selftest's copy figure and each kernel's time
against the estimate's pass model, written to the JSON it names (nothing measured: too small)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "pass_bytes.py"


@pytest.mark.slow
def test_pass_bytes_reports_each_kernel_against_the_pass_model(tmp_path):
    out = tmp_path / "pass_bytes.json"
    subprocess.run([sys.executable, str(SCRIPT), "--mib", "16", "--rounds", "1", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] and result["selftest_device_copy_bytes_per_s"] > 0
    rows = {row["kernel"]: row for row in result["rows"]}
    assert rows["copy"]["bytes_read_and_written_per_value"] == 8 and rows["copy"]["vs_copy"] == 1
    assert rows["sum (a read)"]["bytes_read_and_written_per_value"] == 4
    for row in rows.values():
        # the model divides reads plus writes by twice the copy figure; the one before, by once
        assert row["model_s"] == pytest.approx(row["bytes_read_and_written_per_value"]
                                               * result["values"]
                                               / (2 * result["selftest_device_copy_bytes_per_s"]))
        assert row["model_before_s"] == pytest.approx(2 * row["model_s"])
        assert row["measured_over_model"] == pytest.approx(row["median_s"] / row["model_s"])
