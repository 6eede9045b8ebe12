"""The host state's pages come from the NUMA nodes of the worker's cores, and ranks get cores
socket by socket (zenflow/host/numa.py, zenflow/host/cores.py)."""
from __future__ import annotations

import pytest
import torch

import zenflow
from zenflow.host import cores, numa
from zenflow.host.arena import Arena


def _fake_nodes(tmp_path, lists: dict[int, str]) -> str:
    for node, cpulist in lists.items():
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "online").write_text("0-1\n")   # not a node
    return str(tmp_path)


def test_the_worker_cores_name_their_nodes(tmp_path):
    node_dir = _fake_nodes(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    assert numa.node_cpus(node_dir) == {0: {0, 1, 2, 3, 8, 9, 10, 11},
                                        1: {4, 5, 6, 7, 12, 13, 14, 15}}
    assert numa.nodes_for([5, 13], node_dir) == [1]
    assert numa.nodes_for([3, 4], node_dir) == [0, 1]


def test_one_node_leaves_placement_to_linux(tmp_path):
    assert numa.nodes_for([0, 1], _fake_nodes(tmp_path, {0: "0-1"})) == []
    assert numa.nodes_for([0], str(tmp_path / "absent")) == []


def _policy_or_skip(address: int):
    try:
        return numa.policy_of(address)
    except (KeyError, OSError) as exc:   # another architecture, or the kernel refuses
        pytest.skip(f"get_mempolicy unavailable here: {exc!r}")


def test_an_arena_placed_on_a_node_has_that_policy():
    arena = Arena.create([("master", torch.float32, 4096)], nodes=[0])
    try:
        assert _policy_or_skip(arena.views["master"].data_ptr()) == (numa.MPOL_PREFERRED, [0])
    finally:
        arena.release()
    plain = Arena.create([("master", torch.float32, 4096)])
    try:
        assert _policy_or_skip(plain.views["master"].data_ptr())[0] == 0   # MPOL_DEFAULT
    finally:
        plain.release()


def test_the_optimizer_places_its_host_state_where_its_worker_runs(monkeypatch):
    asked = []

    def worker_nodes(cpus, node_dir=numa.NODE_DIR):
        asked.append(list(cpus))
        return [0]
    monkeypatch.setattr(numa, "nodes_for", worker_nodes)
    model = torch.nn.Linear(16, 16)
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25) as opt:
        host = opt._pipeline.host
        assert asked and asked[0] == opt._pipeline.worker_cores
        assert _policy_or_skip(host.arena.views["master"].data_ptr()) == (numa.MPOL_PREFERRED,
                                                                           [0])


def _fake_topology(tmp_path, packages: dict[int, int]) -> str:
    for cpu, package in packages.items():
        base = tmp_path / f"cpu{cpu}" / "topology"
        base.mkdir(parents=True)
        (base / "physical_package_id").write_text(f"{package}\n")
        (base / "core_id").write_text(f"{cpu // 2}\n")
    return str(tmp_path)


def test_cores_are_ordered_socket_by_socket(tmp_path, monkeypatch):
    # Many servers number CPUs round-robin over the sockets: 0, 2, 4, 6 on one, 1, 3, 5, 7 on
    # the other. Two ranks must each get one socket, not half of both.
    topology = _fake_topology(tmp_path, {c: c % 2 for c in range(8)})
    assert cores._physical_cores(list(range(8)), topology) == [[0], [2], [4], [6],
                                                                 [1], [3], [5], [7]]
    real = cores._physical_cores
    monkeypatch.setattr(cores, "_physical_cores", lambda cpus: real(cpus, topology))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cores.local_rank_share(list(range(8))) == [1, 3, 5, 7]


def test_shares_are_equal_and_cut_where_pages_and_vectors_allow():
    assert numa.share_bounds(10 * 4096, 2) == [0, 5 * 4096, 10 * 4096]
    assert numa.share_bounds(3 * 4096 + 5, 2) == [0, 4096, 3 * 4096 + 5]   # cut rounded down
    assert numa.share_bounds(100, 2) == [0, 0, 100]     # too small to share: all on the last
    assert numa.share_bounds(100, 1) == [0, 100]
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        numa.share_bounds(100, 0)


def test_each_buffer_is_shared_out_over_the_nodes():
    # fp32 buffer of 8192 elements at 0, a bf16 one of the same length at 32768, and a tiny one
    regions = [(0, 8192, 4), (32768, 8192, 2), (49152, 2, 4)]
    assert numa.spans(regions, 53248, [0, 1]) == [
        (0, 16384, 0), (16384, 16384, 1),     # each fp32 half on its node
        (32768, 8192, 0),                     # the bf16 halves of the same elements too,
        (40960, 12288, 1)]                    # and one too small to cut, on the last node


def test_a_two_node_arena_binds_each_share_to_its_node(monkeypatch):
    calls = []

    def mbind(number, address, length, mode, mask, maxnode, flags):
        calls.append((length.value, mode, [n for n in range(64) if mask[0] >> n & 1]))
        return 0
    monkeypatch.setattr(numa, "_syscall", mbind)
    monkeypatch.setitem(numa._SYSCALLS, numa.platform.machine(), (237, 239))
    arena = Arena.create([("master", torch.float32, 8192), ("install", torch.bfloat16, 8192)],
                         nodes=[0, 1])
    try:
        assert calls == [(16384, numa.MPOL_PREFERRED, [0]), (16384, numa.MPOL_PREFERRED, [1]),
                         (8192, numa.MPOL_PREFERRED, [0]), (8192, numa.MPOL_PREFERRED, [1])]
        assert arena.nodes == [0, 1]
    finally:
        arena.release()
