"""`zenflow selftest` on the CPU: it passes here, its JSON has every section, and a deliberately
broken transfer path (copies that report done before their bytes land) makes it fail."""
import json

import pytest
import torch

from zenflow.host.transfers import Ticket, Transfers
from zenflow.tools.cli import main
from zenflow.tools.selftest import SECTIONS, run_selftest


@pytest.mark.slow   # the whole selftest: ~20-30 s on two cores
def test_selftest_passes_on_cpu_and_its_json_has_every_section(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PASSED on cpu" in out and "FAIL " not in out
    report = json.loads(path.read_text())
    assert report["passed"] is True
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["checks"], name
        assert section["status"] in ("pass", "skip"), (name, section)
    bandwidth = {c["name"]: c for c in report["sections"]["bandwidth"]["checks"]}
    assert bandwidth["pinned D2H / H2D bandwidth"]["status"] == "skip"
    assert bandwidth["pinned D2H / H2D bandwidth"]["detail"] == "n/a on CPU"
    measured = report["measured"]
    for key in ("host_adamw_params_per_s", "host_accumulate_params_per_s",
                "host_adamw_params_per_s_per_core", "host_adamw_moments_params_per_s_per_core",
                "device_adamw_params_per_s", "device_fingerprint_bytes_per_s",
                "device_pass_bytes_per_s",
                "memcpy_bytes_per_s", "available_host_bytes"):
        assert measured[key] > 0, key
    worker = {c["name"]: c for c in report["sections"]["worker"]["checks"]}
    assert worker["killed mid-work: clear error within 5 s"]["measured"]["seconds_to_error"] < 5
    assert report["seconds"] < 60


class _EarlyTicket(Ticket):
    """Says the copy is done before its bytes have landed: the ordering step a transfer path
    must not skip."""

    def __init__(self, pairs):
        super().__init__()
        self.pairs = pairs

    def done(self) -> bool:
        return True

    def land(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)
        self.pairs = []


class BrokenCopies(Transfers):
    """Device->host copies whose bytes land one step late (at the next copy), while their
    tickets claim at once that they are done: the worker reads the staging buffer too early."""

    def __init__(self, device):
        super().__init__(device)
        self.pending = None

    def to_host(self, pairs):
        if self.pending is not None:
            self.pending.land()
        self.pending = _EarlyTicket([(dst, src.clone()) for dst, src in pairs])
        return self.pending

    def fence(self, ticket):
        pass


@pytest.mark.slow   # two sections of the selftest: ~5-10 s
def test_a_broken_transfer_path_makes_the_selftest_fail():
    report = run_selftest("cpu", transfers=BrokenCopies, sections=("correctness", "transfers"))
    assert report["passed"] is False
    assert report["sections"]["transfers"]["status"] == "fail"
    assert report["sections"]["correctness"]["status"] == "fail"
    failed = [c for c in report["sections"]["correctness"]["checks"] if c["status"] == "fail"]
    assert any("first mismatch" in c["detail"] for c in failed)


def test_the_unbroken_transfer_path_passes_the_same_sections():
    report = run_selftest("cpu", sections=("transfers",))
    assert report["passed"] is True, report["sections"]["transfers"]


class WorkBeforeTheCopy(Transfers):
    """Runs to_device's `then` before queueing the copy it must follow."""

    def to_device(self, pairs, then=None):
        if then is not None:
            then()
        return super().to_device(pairs)


def test_work_queued_after_a_copy_is_checked_to_follow_it():
    from zenflow.tools.selftest_checks import _Ctx
    from zenflow.tools.selftest_transfers import work_after_a_copy
    cpu = torch.device("cpu")
    assert work_after_a_copy(_Ctx(cpu, torch.float32, None, False)).status == "pass"
    broken = work_after_a_copy(_Ctx(cpu, torch.float32, WorkBeforeTheCopy, False))
    assert broken.status == "fail" and "3 read other values" in broken.detail


def test_unknown_section_is_refused(capsys):
    assert main(["selftest", "--sections", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_gpu_check_without_a_gpu_skips_with_a_message(tmp_path, capsys, monkeypatch):
    from zenflow.tools import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    assert "gpu-check: skipped: no CUDA device" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_gpu_check_dry_run_passes_on_the_cpu(tmp_path):
    """The GPU sections at the CPU's sizes: a real model against the reference, the speed
    comparison; JSON written, GPU named. (The closure section, step(closure) with checkpointing
    under a deadline, starts a process for each dtype: the selftest's test above runs it.)"""
    import json

    from zenflow.tools import gpu_check
    assert gpu_check.main(["--dry-run", "--out-dir", str(tmp_path),
                           "--sections", "model,pagelocks,speed"]) == 0
    result = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    assert result["passed"] and result["gpu"] == "cpu"
    fp32 = result["selftest"]["fp32"]["sections"]
    assert [c["status"] for c in fp32["model"]["checks"]] == ["pass"] * 3
    assert fp32["pagelocks"]["status"] == "skip" and "closure" not in fp32
    ratios = fp32["speed"]["checks"][0]["measured"]["zenflow_over_adamw"]
    assert set(ratios) == {"defaults", "mean, bf16 sums"} and min(ratios.values()) > 0


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_bf16_weights_match_the_reference_under_every_credit_rule():
    """bf16 parameters against the reference fed the same gradients, "moments" included: the
    device's interim steps compute in fp32 and round once, as the reference does (products of
    bf16 gradients and rates rounded to bf16 put the weights 2 ulps off it in a few steps)."""
    report = run_selftest("cpu", "bf16", sections=["correctness"])
    failed = [c["name"] for c in report["sections"]["correctness"]["checks"]
              if c["status"] != "pass"]
    assert report["passed"], failed
