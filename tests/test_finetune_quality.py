"""benchmarks/finetune_quality.py runs end to end (tiny sizes) and reports what it claims."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_quick_run_of_the_second_direction_with_an_emulated_slow_host(tmp_path):
    """One quick run (starting the script, its corpora and pretraining are most of the time):
    BBC News -> Shakespeare at width 256; OffloadAdamW and ZenFlow at U=1 without overlap equal
    AdamW (docs/semantics.md); the auto windows of a host emulated as four device steps slow are
    at least four steps long, under deferred_credit "moments" with every window sum on the CPU
    "device"; the pretrained weights are cached."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_quality.py"), "--quick",
                    "--quiet", "--seeds", "0", "--direction", "bbc-to-shakespeare", "--systems",
                    "AdamW", "OffloadAdamW", "moments, host 4 steps slow",
                    "--zenflow", '{"update_interval": 1, "overlap_step": false}',
                    "--out", str(tmp_path), "--name", "q"],
                   check=True, env=env, timeout=300, cwd=tmp_path)
    result = json.loads((tmp_path / "q.json").read_text())
    summary = result["summary"]
    assert set(summary) == {"AdamW", "OffloadAdamW", "moments, host 4 steps slow",
                            "ZenFlow update_interval=1 overlap_step=False"}
    assert result["direction"] == "bbc-to-shakespeare" and result["model"]["n_embd"] == 256
    assert (tmp_path / "q.png").exists()
    assert list((tmp_path / "cache" / "zenflow" / "finetune_quality").glob("pretrained-*.pt"))
    adamw = summary["AdamW"]["new_loss"]["mean"]
    assert summary["OffloadAdamW"]["new_loss"]["mean"] == pytest.approx(adamw, rel=1e-5)
    assert summary["ZenFlow update_interval=1 overlap_step=False"]["new_loss"]["mean"] == \
        pytest.approx(adamw, rel=1e-5)
    assert summary["OffloadAdamW"]["new_gap_pct"] == pytest.approx(0.0, abs=1e-3)
    assert all(r["new_loss"] > 0 and r["old_loss"] > 0 for r in result["runs"])
    slow = [r for r in result["runs"] if r["system"] == "moments, host 4 steps slow"]
    assert slow and all(r["windows"] <= math.ceil(result["setting"]["steps"] / 4) for r in slow)
    assert all(r["moments_matrices"] > 0 for r in slow)
    assert "old_gap_pct" in summary["moments, host 4 steps slow"]


def test_runs_of_separate_seeds_merge_into_one_result(tmp_path):
    """A long comparison runs seed by seed (each file survives an interruption); --merge keeps
    the systems every file has and summarizes their runs together."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import finetune_quality as fq

    def part(seed, systems, new):
        runs = [{"system": s, "seed": seed, "new_loss": new[s], "old_loss": 2.0,
                 "median_step_s": 0.1, "reselections": 0, "mean_window_steps": 4.0}
                for s in systems]
        return {"setting": {"steps": 3}, "direction": "shakespeare-to-bbc", "model": {"w": 1},
                "machine": "a test",
                "systems": {s: {} for s in systems}, "runs": runs, "wall_s": 1.0}
    paths = []
    for seed, systems, new in ((0, ["AdamW", "moments, U=4", "seeds' block, U=4"],
                                {"AdamW": 1.0, "moments, U=4": 1.02, "seeds' block, U=4": 1.1}),
                               (1, ["AdamW", "moments, U=4"],
                                {"AdamW": 2.0, "moments, U=4": 2.04})):
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(part(seed, systems, new)))
    assert fq.main(["--merge", *map(str, paths), "--out", str(tmp_path), "--name", "m"]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["seeds"] == [0, 1] and list(merged["summary"]) == ["AdamW", "moments, U=4"]
    assert merged["summary"]["moments, U=4"]["new_gap_pct"] == pytest.approx(100 * (1.53 / 1.5 - 1))
    other = {**part(2, ["AdamW"], {"AdamW": 1.0}), "direction": "bbc-to-shakespeare"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differ in 'direction'"):
        fq.main(["--merge", str(paths[0]), str(tmp_path / "other.json"), "--out", str(tmp_path)])


@pytest.mark.parametrize("ranks", ["0", "3"])
def test_ranks_that_cannot_split_the_batch_are_refused_before_any_work(ranks, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import finetune_quality as fq
    with pytest.raises(SystemExit):
        fq.main(["--quick", "--ranks", ranks, "--out", "/nonexistent"])
    assert f"--ranks {ranks}: must be at least 1 and divide the batch of 8" in capsys.readouterr().err
