"""OffloadAdamW: the synchronous ZeRO-Offload baseline, on the same host code as ZenFlow.

Every step ships every gradient to the host in fp32, runs AdamW over every parameter there and
ships the weights back before step() returns: the device waits for all of it. This is what
ZenFlow is measured against.
"""
from __future__ import annotations

import torch

from zenflow import _checks, columns
from zenflow.device_adam import hyper
from zenflow.host import HostJob, HostState
from zenflow.kernels import clip_coefficient, gradient_norms
from zenflow.telemetry import StepTimer

_NAME = "OffloadAdamW"


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory, updated synchronously."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, max_grad_norm: float | None = None):
        self.max_grad_norm = (None if max_grad_norm is None else
                              _checks.number(_NAME, "max_grad_norm", max_grad_norm, low=0.0,
                                             low_open=True))
        params = _checks.param_list(_NAME, params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.device = _checks.parameters(_NAME, self._params)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._host = HostState.allocate(self._params, num_slots=1)
        self._steps = [0] * len(self._params)
        self.skipped_steps = 0
        self._timer = StepTimer()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_host"):
            raise NotImplementedError(f"{_NAME}: add_param_group after construction is not "
                                      "supported; pass every group to the constructor")
        super().add_param_group(param_group)
        _checks.group_hyperparameters(_NAME, self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        present = [(i, p) for i, p in enumerate(self._params) if p.grad is not None]
        if not present:
            return loss
        self._timer.begin()
        clip_coef = clip_coefficient(gradient_norms([p.grad for _, p in present]),
                                      self.max_grad_norm)
        if clip_coef is None:
            self.skipped_steps += 1
            self._timer.end(skipped=True)
            return loss
        jobs = []
        for i, p in present:
            buffer = self._host.matrices[i].grad_sums[0]
            columns.copy_(buffer, p.grad.reshape(buffer.shape).to(buffer.device))
            if clip_coef != 1.0:
                buffer.mul_(clip_coef)
            self._steps[i] += 1
            jobs.append(HostJob(i, self._steps[i], 1, *hyper(self._group_of[p])))
        self._host.update(jobs, slot=0, clear=False)  # the next step overwrites the buffers
        for i, p in present:
            columns.copy_(p.data.view(self._host.matrices[i].master.shape),
                          self._host.matrices[i].master)
        self._timer.end()
        return loss

    def synchronize(self) -> None:
        """Nothing is ever in flight; present for API parity with ZenFlowAdamW."""

    def close(self) -> None:
        """Nothing to release; present for API parity with ZenFlowAdamW."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        return {"steps": sum(1 for r in self._timer.records if not r["skipped"]),
                "skipped_steps": self.skipped_steps, "host_bytes": self._host.nbytes(),
                **self._timer.summary()}

    def state_dict(self) -> dict:
        state = {i: {"step": self._steps[i], "master": m.master.clone(),
                     "exp_avg": m.exp_avg.clone(), "exp_avg_sq": m.exp_avg_sq.clone()}
                 for i, m in enumerate(self._host.matrices)}
        index_of = {p: i for i, p in enumerate(self._params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index_of[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups, "offload": {"skipped_steps": self.skipped_steps}}

    def load_state_dict(self, state_dict: dict) -> None:
        if "offload" not in state_dict:
            raise ValueError(f"{_NAME}: load_state_dict got a state dict not saved by {_NAME}")
        for i, m in enumerate(self._host.matrices):
            s = state_dict["state"][i]
            if s["master"].shape != m.master.shape:
                raise ValueError(f"{_NAME}: load_state_dict: saved state {i} has shape "
                                 f"{tuple(s['master'].shape)}, expected {tuple(m.master.shape)}")
        for i, m in enumerate(self._host.matrices):
            s = state_dict["state"][i]
            self._steps[i] = s["step"]
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(m, name).copy_(s[name])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.skipped_steps = state_dict["offload"]["skipped_steps"]
