"""The update on a multi-node host: each NUMA node's share of the host state updated by a thread
pinned to that node's worker cores (zenflow/host/teams.py), with the same results as one thread;
a team out of work takes the others'; errors reach the caller; close() leaves no thread."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from zenflow.host import buffers, numa
from zenflow.host.buffers import HostState
from zenflow.host.commands import Update
from zenflow.host.layout import HostJobs, HostLayout
from zenflow.host.teams import NodeTeams
from zenflow.host.worker import WorkerHostRunner

from helpers.host_update import JOBS, SHAPES, _host, _results, _update_in_passes

CPUS = sorted(os.sched_getaffinity(0))
# Two "nodes" out of this machine's CPUs: each its own where there are two, else sharing one.
TWO_NODES = [CPUS[:1], CPUS[1:2] or CPUS[:1]]


def _team_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("zenflow-node-team")]


def test_node_shares_updated_by_their_teams_equal_one_thread(monkeypatch):
    monkeypatch.setattr(buffers, "PIECE", 256)   # many chunks on both sides of the cut
    one, two = _host(), _host()
    _update_in_passes(one, JOBS, 0)
    two.arena.nodes = [0, 1]    # as if the arena were shared out over two nodes
    two.teams = NodeTeams(TWO_NODES)
    handed = []
    run = two.teams.run
    monkeypatch.setattr(two.teams, "run", lambda shares: handed.append(shares) or run(shares))
    try:
        two.update(JOBS, 0)
        assert all(handed[0])   # each node was handed its share of the chunks
    finally:
        two.teams.close()
    for name, value in _results(one).items():
        assert torch.equal(value, _results(two)[name]), name
    assert not _team_threads()


def test_a_team_without_cores_has_its_share_run_by_the_others(monkeypatch):
    monkeypatch.setattr(buffers, "PIECE", 256)
    one, two = _host(), _host()
    _update_in_passes(one, JOBS, 0)
    two.arena.nodes = [0, 1]
    two.teams = NodeTeams([CPUS[:1], []])
    try:
        assert two.teams.threads == [1, 0]
        two.update(JOBS, 0)
        assert two.teams.ran[0] > 0 and two.teams.ran[1] == 0
    finally:
        two.teams.close()
    for name, value in _results(one).items():
        assert torch.equal(value, _results(two)[name]), name


def test_a_failing_task_raises_in_the_caller_and_the_teams_go_on():
    teams = NodeTeams(TWO_NODES)
    done = []
    try:
        def fail():
            raise IndexError("chunk out of range")
        with pytest.raises(IndexError, match="chunk out of range"):
            teams.run([[fail], [lambda: done.append(1)]])
        teams.run([[lambda: done.append(2)], [lambda: done.append(3)]])
        assert sorted(done)[-2:] == [2, 3]
        with pytest.raises(ValueError, match=r"one list per node \(2\), got 1"):
            teams.run([[]])
    finally:
        teams.close()
    assert not _team_threads()
    with pytest.raises(RuntimeError, match="after close"):
        teams.run([[], []])
    with pytest.raises(ValueError, match="must give some node a core, got \\[\\[\\], \\[\\]\\]"):
        NodeTeams([[], []])


def test_each_team_runs_on_its_nodes_cores():
    teams = NodeTeams(TWO_NODES)
    seen = []

    def task():   # whichever team runs it (a free team takes the other's work)
        team = int(threading.current_thread().name.rsplit("-", 1)[1])
        seen.append((sorted(os.sched_getaffinity(0)) == TWO_NODES[team],
                     torch.get_num_threads() == len(TWO_NODES[team])))
    try:
        teams.run([[task] * 20, [task] * 20])
    finally:
        teams.close()
    assert seen == [(True, True)] * 40


def test_the_worker_updates_each_nodes_share_on_its_cores(tmp_path, monkeypatch):
    # A worker handed an arena shared over two nodes builds a team per node; its update equals
    # the update in passes. The node directory is faked: both "nodes" hold every CPU.
    cpulist = ",".join(map(str, CPUS))
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    monkeypatch.setattr(numa.cores_by_node, "__defaults__", (str(tmp_path),))
    one = _host()
    _update_in_passes(one, JOBS, 0)
    two = _host()
    two.arena.nodes = [0, 1]
    runner = WorkerHostRunner(two, CPUS)
    try:
        runner.send(Update(0, HostJobs.of(JOBS)))
        runner.wait()
        assert runner.team_threads == [len(CPUS), len(CPUS)]   # a team per node
    finally:
        runner.close()
    for name, value in _results(one).items():
        assert torch.equal(value, _results(two)[name]), name


def test_layouts_cut_over_nodes_keep_every_element():
    host = HostState.allocate(HostLayout.build(SHAPES, sum_slots=1))
    bounds = numa.share_bounds(host.layout.numel, 3)
    covered = []
    for offset, numel, _ in host.layout.fp32_runs(list(range(len(SHAPES)))):
        covered += [range(a, b) for _, a, b in buffers.chunks(offset, numel, bounds, [1, 2, 3])]
    assert sorted(i for r in covered for i in r) == list(range(host.layout.numel))


def test_a_thread_per_core_runs_each_task_on_one_core_with_one_torch_thread():
    """per_core: every core of a node its own thread (for the "factored" update's many small
    operators, zenflow/host/factored.py), pinned to it, one torch thread; the node's tasks go
    to whichever is free, and all of them run."""
    teams = NodeTeams([CPUS], per_core=True)
    seen = []
    lock = threading.Lock()

    def task():
        with lock:
            seen.append((threading.get_ident(), tuple(sorted(os.sched_getaffinity(0))),
                         torch.get_num_threads()))
    try:
        assert len(_team_threads()) == len(CPUS)
        teams.run([[task] * 40])
    finally:
        teams.close()
    assert not _team_threads()
    assert len(seen) == 40
    assert {(cpus, threads) for _, cpus, threads in seen} <= {((c,), 1) for c in CPUS}
    assert len({ident for ident, _, _ in seen}) <= len(CPUS)
