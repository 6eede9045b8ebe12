"""Seeded fuzzing of every input a user hands the library: the DeepSpeed JSON (as a dict, as a
file through `zenflow check-config`) and the optimizer constructors' arguments.

The contract: nothing raises but the library's own ValueError / TypeError / ConfigError, and
every such error names the key or argument that was changed. A config that is accepted also
builds its optimizer (the JSON's bounds are never looser than the constructor's).
"""
import copy
import json
import math
import random

import numpy as np
import pytest
import torch

import zenflow
from zenflow.config.deepspeed_json import (
    ConfigError,
    optimizer_kwargs,
    parse_config,
    resolved_settings,
)
from zenflow.tools.cli import main as cli_main

BASE = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 10,
                                                      "total_num_steps": 100}},
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "zenflow": {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
                    "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True,
                    "auto_ratio": 0.99, "pt_reserved_cores_perc": 0.5}},
}

# Values a hostile or careless user might write anywhere.
NASTY = [None, True, False, 0, 1, -1, 2, 3, 7, 2**31, 10**30, -(10**30), 0.5, 1.5, -0.5, 1e-30,
         1e30, 1e308, math.inf, -math.inf, math.nan, "", "auto", "0.1", "cpu", "nvme", "epoch",
         "WarmupLR", "WarmupCosineLR", "AdamW", "SGD", "x" * 500, [], [0.9], [0.9, 0.999, 1],
         [0.9, 1.0], ["a", "b"], {}, {"a": 1}, {"type": "AdamW"}, [[[[]]]], {"enabled": True},
         np.float32(0.25), np.float64(1e30), np.int64(4), np.int32(-3), np.bool_(True),
         torch.tensor(0.1), torch.tensor([1, 2]), np.array(3.0), object(), 1 + 1j, b"bytes",
         ("tuple", 1)]
NEW_KEYS = ["type", "params", "lr", "topk", "enabled", "stage", "zenflow", "world_size",
            "total_num_steps", "warmup_max_lr", "device", "unknown_key"]


def _paths(tree, prefix=()):
    for key, value in tree.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key,))


def _parent(cfg, path):
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg


def _mutate(cfg, rng):
    """Change 1-3 keys of cfg in place; return the dotted paths that were changed."""
    changed = []
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(cfg))
        path = rng.choice(paths)
        parent = _parent(cfg, path)
        if not isinstance(parent, dict):
            continue
        action = rng.random()
        if action < 0.15:
            parent.pop(path[-1], None)
        elif action < 0.3:
            path = path[:-1] + (rng.choice(NEW_KEYS),)
            parent[path[-1]] = rng.choice(NASTY)
        else:
            parent[path[-1]] = rng.choice(NASTY)
        changed.append(path)
    return changed


def _names_a_changed_key(message, changed):
    """The message names a changed key, or (for a removed or retyped key whose effect shows in
    a sibling, e.g. a new scheduler type missing its total_num_steps) the block holding it."""
    for path in changed:
        if str(path[-1]) in message or (len(path) > 1 and ".".join(path[:-1]) in message):
            return True
    return False


def _tiny_params():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)).parameters()


def _build(cfg):
    kwargs = optimizer_kwargs(cfg)
    if cfg.optimizer_kind == "zenflow":
        opt = zenflow.ZenFlowAdamW(_tiny_params(), worker=False, **kwargs)
    elif cfg.optimizer_kind == "offload":
        opt = zenflow.OffloadAdamW(_tiny_params(), **kwargs)
    else:
        return torch.optim.AdamW(_tiny_params(), **kwargs)
    opt.close()
    return opt


def test_fuzz_dict_configs():
    rng = random.Random(1234)
    outcomes = {"accepted": 0, "refused": 0, "refused_by_constructor": 0}
    for case in range(400):
        cfg = copy.deepcopy(BASE)
        changed = _mutate(cfg, rng)
        try:
            parsed = parse_config(cfg, world_size=1)
        except ConfigError as exc:
            assert exc.problems, (case, changed)
            assert _names_a_changed_key(str(exc), changed), (case, changed, exc.problems)
            outcomes["refused"] += 1
            continue
        json.dumps(resolved_settings(parsed), default=str)
        try:
            _build(parsed)
        except (ValueError, TypeError) as exc:
            # Only what the engine fills in later may be missing here (steps_per_epoch).
            assert "steps_per_epoch" in str(exc), (case, changed, exc)
            assert _names_a_changed_key(str(exc), changed), (case, changed, exc)
            outcomes["refused_by_constructor"] += 1
            continue
        outcomes["accepted"] += 1
    assert outcomes["accepted"] > 20 and outcomes["refused"] > 200, outcomes


def _text_variants(text, rng):
    """JSON text broken the ways files get broken."""
    raw = text.encode()
    cut = rng.randrange(len(raw))
    key = rng.choice(['"train_batch_size"', '"optimizer"', '"lr"', '"stage"', '"topk_ratio"'])
    return [
        raw[:cut],
        raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:],
        raw[:cut] + bytes(rng.randrange(256) for _ in range(8)) + raw[cut:],
        text.replace(key + ":", key + ": 1, " + key + ":", 1).encode(),
        b"[" * rng.randint(30, 100_000) + raw + b"]" * rng.randint(0, 50),
        ("\ufeff" + text).encode(),
        text.encode(rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32"])),
        text.replace('"AdamW"', '"Ad\u00e4mW"').encode("latin-1"),
        raw.replace(b"1e-08", b"NaN").replace(b"0.001", b"Infinity"),
        raw.replace(b"16", b"9" * rng.choice([20, 400, 5000]), 1),
    ]


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_fuzz_check_config_files(tmp_path, capsys):
    rng = random.Random(99)
    file = tmp_path / "ds.json"
    codes = []
    for case in range(40):
        cfg = copy.deepcopy(BASE)
        if case % 2:
            _mutate(cfg, rng)
        try:
            text = json.dumps(cfg)
        except (TypeError, ValueError):
            continue  # a numpy or tensor value: not a file's content
        for variant in _text_variants(text, rng):
            file.write_bytes(variant)
            code = cli_main(["check-config", str(file)])
            out = capsys.readouterr()
            assert code in (0, 1), (case, variant[:200])
            assert "Traceback" not in out.err
            if code == 1:
                assert "  error: " in out.err, out.err
            codes.append(code)
    assert codes.count(1) > 100 and codes.count(0) > 5


# --------------------------------------------------------------------------------------------
# Constructor arguments.

ARGUMENTS = {
    "lr": [1e-3, 0.0, -1.0, 10.0, 11.0, 1e30, math.inf, math.nan, "1e-3", None, np.float32(0.1),
           torch.tensor(0.1), True],
    "betas": [(0.9, 0.999), (0.9,), (0.9, 1.0), (-0.1, 0.9), (math.nan, 0.9), "0.9", 0.9, None,
              (0.9, math.inf), [0.5, 0.5], (np.float64(0.9), 0.99)],
    "eps": [1e-8, 0.0, -1e-8, 1.0, 2.0, math.inf, 1e308, "tiny", None],
    "weight_decay": [0.0, 0.01, -0.1, 10.0, 1e30, math.inf, -math.inf, [0.1], None],
    "max_grad_norm": [None, 1.0, 0.0, -1.0, math.inf, math.nan, "1"],
}
ZENFLOW_ARGUMENTS = {
    "topk_ratio": [0.0, 0.1, 1.0, 1.5, -0.1, math.nan, "0.1", None, np.float32(0.5)],
    "select_strategy": ["auto", "step", "epoch", "random", ["step"], None, 1],
    "select_interval": ["auto", 1, 4, 0, -1, 2.5, 10**6, 10**30, "often", None, True, np.int64(3)],
    "update_interval": ["auto", 1, 4, 0, 100_000, 100_001, 1e30, "4", None, np.int64(2)],
    "full_warm_up_rounds": [0, 3, -1, 10**30, 1.0, True, None],
    "overlap_step": [True, False, "yes", 1, None],
    "importance": ["l2", "l1", "l3", None, 2],
    "steps_per_epoch": [None, 1, 10, 0, -5, 2.5, "10"],
    "pt_reserved_cores_perc": [0.0, 0.5, 1.0, 2.0, -1.0, math.inf, "half"],
    "reselect_threshold": [0.0, 0.6, 1.0, 1.1, math.nan],
    "auto_ratio": [0.99, 0.5, 0.0, 1.0, 1.5, math.inf, -1.0],
    "auto_update_bounds": [(1, 16), (2, 2), (5, 2), (0, 4), (1, 10**30), (1,), "1,16", None,
                           (1.5, 4)],
}


def _group_variants(rng):
    """Param structures: (params argument, the name an error must mention)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    w, b = model[0].weight, model[0].bias
    frozen = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    return rng.choice([
        ([{"params": [w]}, {"lr": 0.1}], "params"),
        ([{"params": [w], "lr": math.inf}, {"params": [b]}], "lr"),
        ([{"params": [w], "eps": -1.0}], "eps"),
        ([{"params": [w], "betas": (0.9, 2.0)}], "betas"),
        ([{"params": w}, {"params": [b], "weight_decay": 1e30}], "weight_decay"),
        ([w, torch.nn.Parameter(torch.zeros(0, 4))], "params"),
        ([w, torch.zeros(3, dtype=torch.int32)], "params"),
        ([w, w], "params"),
        ([w, w * 2], "params"),
        ([w, "bias"], "params"),
        ([], "params"),
        ({"params": [w]}, "params"),
        (w, "params"),
        (5, "params"),
        ([{"params": []}], "params"),
        ([w, b, frozen], None),  # frozen parameters are accepted
        (list(model.named_parameters()), None),
    ])


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_fuzz_constructor_arguments(cls):
    rng = random.Random(7 if cls is zenflow.ZenFlowAdamW else 8)
    table = dict(ARGUMENTS, **(ZENFLOW_ARGUMENTS if cls is zenflow.ZenFlowAdamW else {}))
    extra = {"worker": False} if cls is zenflow.ZenFlowAdamW else {}
    accepted = refused = 0
    for case in range(150):
        kwargs = {name: rng.choice(table[name]) for name in rng.sample(sorted(table),
                                                                       rng.randint(1, 3))}
        names = list(kwargs)
        params = _tiny_params()
        if rng.random() < 0.25:
            params, name = _group_variants(rng)
            names.append(name)
        try:
            opt = cls(params, **kwargs, **extra)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            assert message.startswith(f"{cls.__name__}: "), (case, kwargs, message)
            assert any(n is not None and n in message for n in names), (case, kwargs, message)
            refused += 1
            continue
        opt.close()
        accepted += 1
    assert accepted > 10 and refused > 60, (accepted, refused)
