"""Core placement on a GPU server (zenflow/host/cores.py), on fake topologies: the training
process keeps two physical cores of its rank's share, the worker takes the rest on every socket;
a config's pt_reserved_cores_perc means DeepSpeed's split; ranks on one machine share fairly."""
from __future__ import annotations

import pytest

from zenflow.config.settings import DEFAULTS
from zenflow.host import cores, numa


def _server(tmp_path, sockets: int, per_socket: int, threads: int = 2) -> tuple[str, str]:
    """Fake /sys cpu and node directories of a server numbered as Linux numbers an Intel one:
    physical core k of socket s is CPU s * per_socket + k, its hyperthread sibling that plus
    sockets * per_socket. Returns (cpu dir, node dir); each socket is one NUMA node."""
    cpu_dir, node_dir = tmp_path / "cpu", tmp_path / "node"
    total = sockets * per_socket
    for socket in range(sockets):
        members = []
        for k in range(per_socket):
            for t in range(threads):
                cpu = t * total + socket * per_socket + k
                members.append(cpu)
                base = cpu_dir / f"cpu{cpu}" / "topology"
                base.mkdir(parents=True)
                (base / "physical_package_id").write_text(f"{socket}\n")
                (base / "core_id").write_text(f"{k}\n")
        (node_dir / f"node{socket}").mkdir(parents=True)
        (node_dir / f"node{socket}" / "cpulist").write_text(",".join(map(str, members)) + "\n")
    return str(cpu_dir), str(node_dir)


def _sockets_of(cpus: list[int], node_dir: str) -> list[int]:
    nodes = numa.node_cpus(node_dir)
    return sorted({n for n, members in nodes.items() if members & set(cpus)})


def _place(cpu_dir: str, cpus: list[int], perc, rank: int = 0, world: int = 1):
    share = cores.rank_share(cores._physical_cores(cpus, cpu_dir), rank, world)
    return cores.split(share, perc)


def test_an_unset_reserve_keeps_two_cores(tmp_path):
    cpu_dir, node_dir = _server(tmp_path, sockets=2, per_socket=8)
    training, worker = _place(cpu_dir, list(range(32)), None)
    # two physical cores with their siblings: the Python thread and autograd's device thread
    assert training == [0, 16, 1, 17]
    assert sorted(training + worker) == list(range(32)) and not set(training) & set(worker)
    assert len(worker) == 28 and _sockets_of(worker, node_dir) == [0, 1]   # every socket
    assert numa.nodes_for(worker, node_dir) == [0, 1]
    assert DEFAULTS.pt_reserved_cores_perc is None


def test_a_set_reserve_is_deepspeeds_share(tmp_path):
    cpu_dir, node_dir = _server(tmp_path, sockets=2, per_socket=8)
    training, worker = _place(cpu_dir, list(range(32)), 0.5)
    assert _sockets_of(training, node_dir) == [0] and len(training) == 16
    assert _sockets_of(worker, node_dir) == [1] and len(worker) == 16
    training, worker = _place(cpu_dir, list(range(32)), 0.25)   # ceil(0.25 * 16) cores
    assert len(training) == 8 and len(worker) == 24


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_on_one_server_share_it_fairly(tmp_path, world):
    cpu_dir, node_dir = _server(tmp_path, sockets=2, per_socket=8)
    places = [_place(cpu_dir, list(range(32)), None, rank, world) for rank in range(world)]
    used = [cpu for training, worker in places for cpu in training + worker]
    assert len(used) == len(set(used))     # no core serves two ranks
    assert len({len(t) + len(w) for t, w in places}) == 1     # each rank as many as the others
    assert len(used) >= 32 - 2 * (world - 1)   # at most world - 1 physical cores left over
    for training, worker in places:
        assert worker and training and len(training) <= 2 * cores.TRAINING_CORES
    if world == 2:   # one socket each: each rank's host state on its own node
        assert [_sockets_of(t + w, node_dir) for t, w in places] == [[0], [1]]


def test_three_ranks_leave_the_middle_one_on_both_sockets(tmp_path):
    cpu_dir, node_dir = _server(tmp_path, sockets=2, per_socket=8)
    training, worker = _place(cpu_dir, list(range(32)), None, rank=1, world=3)
    assert _sockets_of(worker, node_dir) == [0, 1]   # its worker uses both, as its share does


@pytest.mark.parametrize("physical, expected", [(2, (1, 1)), (3, (2, 1)), (4, (2, 2)),
                                                (5, (2, 3)), (64, (2, 62))])
def test_small_shares_keep_a_core_for_each_side(physical, expected):
    share = [[c] for c in range(physical)]
    training, worker = cores.split(share, None)
    assert (len(training), len(worker)) == expected


def test_one_cpu_is_shared_and_bad_fractions_are_refused():
    assert cores.split([[7]], None) == ([7], [7])
    with pytest.raises(ValueError, match=r"pt_reserved_cores_perc must be between 0 and 1.*1\.5"):
        cores.split_cores(1.5, [0, 1])


@pytest.fixture
def one_torch_thread(monkeypatch):
    """The training thread on one torch thread, this process allowed 8 CPUs (a test may allow
    fewer), and the thread count as it was afterwards."""
    import torch
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(before)


def test_lent_threads_adds_the_workers_cores_within_the_cpus_and_gives_them_back(
        monkeypatch, one_torch_thread):
    torch = one_torch_thread
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    with cores.lent_threads([5]) as n:
        assert n == torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with cores.lent_threads([5, 6, 7, 8]) as n:   # at most one per CPU this process may use
        assert n == torch.get_num_threads() == 3
    with pytest.raises(RuntimeError), cores.lent_threads([5]):
        raise RuntimeError("a failed move")
    assert torch.get_num_threads() == 1           # given back on an error too
    with cores.lent_threads(None) as n:           # no worker: nothing lent
        assert n == 1
    monkeypatch.setattr(cores, "_openmp", lambda: False)
    with cores.lent_threads([5]) as n:            # torch's native pool keeps its size
        assert n == torch.get_num_threads() == 1


def test_a_reselection_moves_columns_on_the_drained_workers_cores_too(monkeypatch,
                                                                       one_torch_thread):
    """The host's column moves run with the worker's cores lent (they are idle while it is
    drained), and the training thread's count is back afterwards."""
    import zenflow
    from zenflow.optim import handoff
    torch = one_torch_thread
    seen = []
    move = handoff.move_columns
    monkeypatch.setattr(handoff, "move_columns",
                        lambda *a: (seen.append(torch.get_num_threads()), move(*a))[1])
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16, generator=gen))]
    with zenflow.ZenFlowAdamW(params, lr=1e-3, worker=False, topk_ratio=0.25,
                              update_interval=1, select_strategy="step",
                              select_interval=2) as opt:
        opt._pipeline.worker_cores = [6, 7]   # a worker's two cores (this one runs inline)
        for _ in range(4):
            params[0].grad = torch.randn(8, 16, generator=gen)
            opt.step()
    assert seen and set(seen) == {3} and torch.get_num_threads() == 1


def test_state_dict_and_load_copy_on_the_drained_workers_cores_too(monkeypatch,
                                                                   one_torch_thread):
    import zenflow
    from zenflow.host import pipeline_state
    torch = one_torch_thread
    seen = []
    for name in ("_saved_param", "_loaded"):
        inner = getattr(pipeline_state, name)
        monkeypatch.setattr(pipeline_state, name, lambda *a, inner=inner: (
            seen.append(torch.get_num_threads()), inner(*a))[1])
    param = torch.nn.Parameter(torch.randn(8, 16))
    with zenflow.ZenFlowAdamW([param], lr=1e-3, worker=False, topk_ratio=0.25) as opt:
        opt._pipeline.worker_cores = [6, 7]   # a worker's two cores (this one runs inline)
        param.grad = torch.randn(8, 16)
        opt.step()
        opt.load_state_dict(opt.state_dict())
    assert seen == [3, 3] and torch.get_num_threads() == 1
