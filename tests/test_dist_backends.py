"""Collectives follow the group's backend, checked on a CPU: the distributed paths (selection,
reselection with the state handoff, fixed and "auto" windows, installs, a checkpoint and a
resume) run with every torch.distributed collective intercepted (tests/helpers/collective_check.py), and
no tensor may reach a group anywhere its backend does not take it. Declaring the gloo group
"nccl" makes the code take the GPU's path on the CPU; host memory handed to it is what raised on
GPUs before (`.cpu()` before the norm exchange, host install buffers gathered, CPU flags)."""
import pytest
import torch

import zenflow.distributed as zd

from helpers.ddp_factored_ranks import FACTORED, run_ddp_factored
from helpers.dist_ranks import single_process_run
from helpers.spawn import STEPS, assert_ok, assert_same, run_ranks

pytestmark = pytest.mark.slow

PURPOSES = {"exchanging column norms", "installing host-updated rows",  # the optimizer's
            "moving columns to the device"}


@pytest.mark.parametrize("backend,overlap,interval", [("nccl", True, 3), ("nccl", False, "auto"),
                                                      ("gloo", True, 3)])
def test_every_collective_gets_tensors_where_its_backend_wants_them(tmp_path, backend, overlap,
                                                                     interval):
    ranks = run_ranks(tmp_path, "checked", overlap=overlap,
                      options={"backend": backend, "update_interval": interval})
    assert_ok(ranks)
    for r in ranks:
        assert r["violations"] == [], r["violations"][:5]
        if interval != "auto":
            assert r["reselections"] >= 2 and r["windows"] >= 6
        assert PURPOSES <= set(r["purposes"]), r["purposes"]
        assert r["calls"].get("all_reduce") and (r["calls"].get("all_gather_into_tensor") or
                                                 r["calls"].get("all_gather_single"))
        if backend == "nccl":  # the check is not vacuous: the old code's calls are caught
            probes = r["probe_violations"]
            assert all("host memory" in v for v in probes), probes
            assert {v.split(":")[0] for v in probes} & {"all_gather_into_tensor",
                                                        "all_gather_single"}, probes
            assert any(v.startswith("all_reduce:") for v in probes), probes
        else:
            assert r["probe_violations"] == []
    assert_same(ranks[0]["weights"], ranks[1]["weights"], exact=True)
    if interval == "auto":
        assert "agreeing on the end of a host window" in ranks[0]["purposes"]
    else:  # the device path computes what one process computes (with a resume in the middle)
        # (read through the engine's state_dict(), which installs the update in flight)
        assert_same(ranks[0]["weights"],
                    single_process_run(STEPS, overlap, synchronized=True)["weights"], exact=False)


def test_ddp_factored_collectives_get_tensors_where_their_backend_wants_them(tmp_path):
    """deferred_credit="factored" on DDP adds the all-gathers of the factors (at each install,
    and at the first step after a load) and each rank's correction of its rows before they are
    gathered: under a declared NCCL and under gloo (one spawn), no tensor reaches the group where
    its backend does not take it, and both paths compute the same bits, through a resume."""
    runs = {backend: ("checked", {"backend": backend, "settings": FACTORED})
            for backend in ("nccl", "gloo")}
    ranks = run_ddp_factored(tmp_path, runs)
    assert_ok(ranks)
    for r in ranks:
        for backend in ("nccl", "gloo"):
            run = r[backend]
            assert run["violations"] == [], run["violations"][:5]
            assert run["moments_matrices"] == 3
            assert {"installing deferred_credit='factored' factors",
                    "gathering loaded deferred_credit='factored' factors"} <= set(run["purposes"])
            assert_same(run["resumed"], run["straight"], exact=True)
            assert_same(run["weights"], ranks[0]["gloo"]["weights"], exact=True)
        # not vacuous: the host's factors handed to NCCL as they are would be caught
        probes = r["nccl"]["probe_violations"]
        assert probes and all("host memory" in v for v in probes), probes
        assert r["gloo"]["probe_violations"] == []


def test_partition_takes_its_device_from_the_backend(monkeypatch):
    class Fake:
        ReduceOp = torch.distributed.ReduceOp

        def __init__(self, backend):
            self.backend = backend

        def is_available(self):
            return True

        def is_initialized(self):
            return True

        def get_backend(self, group=None):
            return self.backend

        def get_rank(self, group=None):
            return 1

        def get_world_size(self, group=None):
            return 2

    monkeypatch.setattr(zd, "dist", Fake("gloo"))
    p = zd.Partition.from_group(None, torch.device("cpu"))
    assert (p.backend, p.device, p.on_device, p.active) == ("gloo", torch.device("cpu"), False,
                                                            True)
    host = torch.ones(3)
    assert p.from_host(host) is host            # gloo: host data as it is
    monkeypatch.setattr(zd, "dist", Fake("nccl"))
    p = zd.Partition.from_group(None, torch.device("cpu"))
    assert p.on_device and p.device == torch.device("cpu")
    moved = p.from_host(host)                   # NCCL: always a copy on the device
    assert moved is not host and torch.equal(moved, host)
    assert p.rows(5) == slice(3, 5) and p.rows_per_rank(5) == 3
