"""The DeepSpeed-style config: defaults, DeepSpeed's batch-size rule, and errors that name keys."""
import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from zenflow.config.deepspeed_json import (
    ConfigError,
    ZenFlowSection,
    load_config_dict,
    optimizer_kwargs,
    parse_config,
    resolved_settings,
)
from zenflow.tools.cli import main as cli_main

from helpers.engine_toys import SEED_ZERO_BLOCK

BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def with_(**overrides):
    cfg = copy.deepcopy(BASE)
    cfg.update(copy.deepcopy(overrides))
    return cfg


def test_seed_block_parses_to_zenflow_with_deepspeed_defaults():
    cfg = parse_config(with_(**SEED_ZERO_BLOCK), world_size=1)
    assert cfg.optimizer_kind == "zenflow"
    kw = optimizer_kwargs(cfg)
    assert kw["topk_ratio"] == 0.05 and kw["update_interval"] == 4 and kw["overlap_step"] is True
    assert kw["select_strategy"] == "auto" and kw["select_interval"] == "auto"
    # keys the seed leaves out take DeepSpeed 0.19's defaults, except the core split (None: the
    # worker gets every core but two, docs/deepspeed.md)
    assert kw["auto_ratio"] == 0.99 and kw["pt_reserved_cores_perc"] is None
    assert kw["steps_per_epoch"] is None and cfg.zenflow.offload is False
    assert "offload" not in kw  # accepted, logged as having no effect, not passed on
    assert kw["max_grad_norm"] is None  # no gradient_clipping in the config


def test_empty_zenflow_block_has_deepspeed_defaults():
    z = ZenFlowSection()
    assert z.model_dump() == {
        "topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
        "update_interval": "auto", "overlap_step": False, "offload": False, "auto_ratio": 0.99,
        "full_warm_up_rounds": 0, "steps_per_epoch": None,
        # ours, not DeepSpeed's: the constructor's defaults
        "deferred_credit": "factored", "install_lookahead": 1.0, "pt_reserved_cores_perc": None,
        "host_moments_dtype": "float32"}
    cfg = parse_config(with_(zero_optimization={"stage": 2, "zenflow": {}}), world_size=1)
    assert cfg.optimizer_kind == "zenflow"


def test_optimizer_kind_follows_offload_and_zenflow_blocks():
    assert parse_config(BASE, world_size=1).optimizer_kind == "adamw"
    off = with_(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                gradient_clipping=1.0)
    cfg = parse_config(off, world_size=1)
    assert cfg.optimizer_kind == "offload" and optimizer_kwargs(cfg)["max_grad_norm"] == 1.0
    none = with_(zero_optimization={"stage": 1, "offload_optimizer": {"device": "none"}})
    assert parse_config(none, world_size=1).optimizer_kind == "adamw"


@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 8}, 1, (32, 4, 8)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 1, (32, 4, 8)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 16}, 2, (16, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
])
def test_batch_size_rule(given, world, expected):
    cfg = parse_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == expected


def test_ignored_keys_are_accepted_and_listed():
    cfg = parse_config(with_(wall_clock_breakdown=True, zero_allow_untested_optimizer=True,
                             steps_per_print=10,
                             zero_optimization={"stage": 2, "overlap_comm": True,
                                                "offload_optimizer": {"device": "cpu",
                                                                      "buffer_count": 4}}),
                       world_size=1)
    assert cfg.ignored_keys() == ["steps_per_print", "wall_clock_breakdown",
                                  "zero_allow_untested_optimizer",
                                  "zero_optimization.offload_optimizer.buffer_count",
                                  "zero_optimization.overlap_comm"]
    assert resolved_settings(cfg)["ignored_keys"] == cfg.ignored_keys()


def test_unimplemented_zenflow_offload_is_shown_as_ignored():
    cfg = parse_config(with_(zero_optimization={"stage": 2, "zenflow": {"offload": True}}),
                       world_size=1)
    settings = resolved_settings(cfg)
    assert "offload" not in settings["optimizer_kwargs"]
    assert settings["ignored_keys"] == ["zero_optimization.zenflow.offload"]


def test_scheduler_params_get_defaults():
    cfg = parse_config(with_(scheduler={"type": "WarmupCosineLR",
                                        "params": {"total_num_steps": 2000}}), world_size=1)
    name, params = resolved_settings(cfg)["scheduler"]
    assert name == "WarmupCosineLR"
    assert params == {"total_num_steps": 2000, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                      "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1}


# (config, the key path the error must name, a phrase the message must contain)
MALFORMED = [
    (with_(zero_optimization={"zenflow": {"topk_ratio": 1.5}}),
     "zero_optimization.zenflow.topk_ratio", "must be between 0 and 1, got 1.5"),
    (with_(zero_optimization={"zenflow": {"topk_ratio": "0.1"}}),
     "zero_optimization.zenflow.topk_ratio", "must be a number"),
    (with_(zero_optimization={"zenflow": {"update_interval": 0}}),
     "zero_optimization.zenflow.update_interval", '"auto" or a positive integer'),
    (with_(zero_optimization={"zenflow": {"select_interval": "often"}}),
     "zero_optimization.zenflow.select_interval", '"auto" or a positive integer'),
    (with_(zero_optimization={"zenflow": {"select_strategy": "random"}}),
     "zero_optimization.zenflow.select_strategy", "'auto', 'step', 'epoch' or 'drift'"),
    (with_(zero_optimization={"zenflow": {"overlap_step": "yes"}}),
     "zero_optimization.zenflow.overlap_step", "must be true or false"),
    (with_(zero_optimization={"zenflow": {"full_warm_up_rounds": -1}}),
     "zero_optimization.zenflow.full_warm_up_rounds", "must be >= 0"),
    (with_(zero_optimization={"zenflow": {"auto_ratio": 2}}),
     "zero_optimization.zenflow.auto_ratio", "between 0 and 1"),
    (with_(zero_optimization={"zenflow": {"auto_ratio": -0.1}}),
     "zero_optimization.zenflow.auto_ratio", "between 0 and 1, got -0.1"),
    (with_(zero_optimization={"zenflow": {"pt_reserved_cores_perc": -0.5}}),
     "zero_optimization.zenflow.pt_reserved_cores_perc", "between 0 and 1"),
    (with_(zero_optimization={"zenflow": {"topk": 0.1}}),
     "zero_optimization.zenflow.topk", "is not a known key"),
    (with_(zero_optimization={"stage": 4}),
     "zero_optimization.stage", "must be 0, 1, 2 or 3, got 4"),
    (with_(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
     "zero_optimization.offload_optimizer.device", "'nvme', which is not supported"),
    (with_(zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": "true"}}),
     "zero_optimization.offload_optimizer.pin_memory", "must be true or false"),
    (with_(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
     "zero_optimization.offload_param", "stage 3"),
    (with_(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4),
     "train_batch_size", "= 16, got 32"),
    ({"optimizer": {"type": "AdamW"}}, "train_batch_size", "is missing"),
    (with_(train_batch_size="8"), "train_batch_size", "must be an integer, got '8'"),
    (with_(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu", "must be > 0"),
    (with_(gradient_accumulation_steps=2.5), "gradient_accumulation_steps", "must be an integer"),
    (with_(optimizer={"type": "SGD"}), "optimizer.type", "got 'SGD'"),
    (with_(optimizer={"type": "AdamW", "params": {"lr": -1e-3}}), "optimizer.params.lr",
     "must be >= 0"),
    (with_(optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.5]}}),
     "optimizer.params.betas[1]", "between 0 and 1"),
    (with_(optimizer={"type": "Adam", "params": {"adam_w_mode": False}}),
     "optimizer.params.adam_w_mode", "not supported"),
    (with_(scheduler={"type": "OneCycle"}), "scheduler.type", "got 'OneCycle'"),
    (with_(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}),
     "scheduler.params.total_num_steps", "is required"),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cubic"}}),
     "scheduler.params.warmup_type", "'log' or 'linear'"),
    (with_(scheduler={"type": "WarmupLR", "params": [1]}), "scheduler.params",
     "must be an object, got [1]"),
    (with_(fp16={"enabled": True, "hysteresis": 0}), "fp16.hysteresis", "must be > 0"),
    (with_(fp16={"enabled": True}, bf16={"enabled": True}), "bf16.enabled", "at most one"),
    (with_(gradient_clipping=-1.0), "gradient_clipping", "must be >= 0"),
    (with_(bogus_key=1), "bogus_key", "is not a known key"),
    (with_(zero_optimization="stage2"), "zero_optimization", "must be an object"),
    # finite and sane bounds
    (with_(optimizer={"type": "AdamW", "params": {"lr": 1e30}}), "optimizer.params.lr",
     "must be <= 10, got 1e+30"),
    (with_(optimizer={"type": "AdamW", "params": {"lr": float("inf")}}), "optimizer.params.lr",
     "must be <= 10, got inf"),
    (with_(optimizer={"type": "AdamW", "params": {"eps": 1e308}}), "optimizer.params.eps",
     "must be <= 1, got 1e+308"),
    (with_(optimizer={"type": "AdamW", "params": {"weight_decay": 1e30}}),
     "optimizer.params.weight_decay", "must be <= 10, got 1e+30"),
    (with_(zero_optimization={"zenflow": {"update_interval": 10**30}}),
     "zero_optimization.zenflow.update_interval", '"auto" or an integer <= 100000, got 1000'),
    (with_(zero_optimization={"zenflow": {"select_interval": 1e30}}),
     "zero_optimization.zenflow.select_interval", '"auto" or a positive integer, got 1e+30'),
    (with_(zero_optimization={"zenflow": {"full_warm_up_rounds": 10**30}}),
     "zero_optimization.zenflow.full_warm_up_rounds", "must be <= 1e+09"),
    (with_(train_batch_size=10**30), "train_batch_size", "must be <= 1e+09"),
    (with_(fp16={"enabled": True, "loss_scale": 1e30}), "fp16.loss_scale", "must be <= 1.8"),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.01,
                                                      "warmup_max_lr": 0.001}}),
     "scheduler.params.warmup_min_lr", "must be <= warmup_max_lr (0.001), got 0.01"),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.01}}),
     "scheduler.params.warmup_min_lr", "defaults to optimizer.params.lr (0.001), got 0.01"),
    (with_(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 5,
                                                           "warmup_num_steps": 10}}),
     "scheduler.params.total_num_steps", "must be >= warmup_num_steps (10), got 5"),
    (with_(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}),
     "scheduler.params.total_num_steps", "(1000, its default), got 100"),
    (with_(scheduler={"type": "WarmupLR", "params": {"last_batch_iteration": -5}}),
     "scheduler.params.last_batch_iteration", "must be >= -1"),
    (with_(scheduler={"type": ["WarmupLR"]}), "scheduler.type", "got ['WarmupLR']"),
    (with_(scheduler={"type": "WarmupDecayLR", "params": None}),
     "scheduler.params.total_num_steps", "is required"),
    (with_(scheduler={"type": "WarmupCosineLR"}), "scheduler.params.total_num_steps",
     "is required"),
    (with_(scheduler={"type": {"name": "WarmupLR"}}), "scheduler.type", "must be one of"),
]


@pytest.mark.parametrize("cfg,path,phrase", MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_config_names_the_key(cfg, path, phrase, tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg, world_size=1)
    first = err.value.problems[0]
    assert first.startswith(path + " "), first
    assert phrase in first, first
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(cfg))
    assert cli_main(["check-config", str(file)]) == 1
    assert path in capsys.readouterr().err


def test_at_least_fifteen_malformed_cases():
    assert len(MALFORMED) >= 15


@pytest.mark.slow   # two child processes
def test_check_config_cli_in_a_subprocess(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(with_(**SEED_ZERO_BLOCK)))
    bad.write_text(json.dumps(with_(zero_optimization={"stage": 4})))
    env = dict(os.environ, WORLD_SIZE="1")
    ok = subprocess.run([sys.executable, "-m", "zenflow.tools.cli", "check-config", str(good)],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "zenflow.ZenFlowAdamW" in ok.stdout and "topk_ratio: 0.05" in ok.stdout
    fail = subprocess.run([sys.executable, "-m", "zenflow.tools.cli", "check-config", str(bad)],
                          capture_output=True, text=True, env=env)
    assert fail.returncode == 1
    assert "zero_optimization.stage must be 0, 1, 2 or 3, got 4" in fail.stderr


def test_check_config_reports_unreadable_files(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{\"train_batch_size\": 8,")
    assert cli_main(["check-config", str(broken)]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert cli_main(["check-config", str(tmp_path / "missing.json")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_check_config_json_output(tmp_path, capsys):
    file = tmp_path / "c.json"
    file.write_text(json.dumps(with_(fp16={"enabled": True, "initial_scale_power": 8})))
    assert cli_main(["check-config", str(file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "torch.optim.AdamW"
    assert out["loss_scaling"]["initial_scale"] == 256.0
    assert out["precision"].startswith("fp16")


# (file content, phrase): files that are not UTF-8 JSON objects. None of them may traceback.
BAD_FILES = [
    ('{"train_batch_size": 8, "seed": "caf\u00e9"}'.encode("latin-1"),
     "is not UTF-8 text: byte 0xe9 at offset 36"),
    (json.dumps(BASE).encode("utf-16"), "is UTF-16 or UTF-32 text; save it as UTF-8"),
    (json.dumps(BASE).encode("utf-16-le"), "is UTF-16 or UTF-32 text"),
    (bytes(range(256)) * 4, "is not UTF-8 text"),
    (b"\x00\x01\x02\x03", "is not valid JSON"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests objects and lists 100001 levels"),
    (b"[" * 100_000, "nests objects and lists 100000 levels deep; at most 32"),
    (b'{"train_batch_size": ' + b"9" * 5000 + b"}", "is not valid JSON"),
    (b'{"train_batch_size": 8, "train_batch_size": 16}',
     "train_batch_size appears more than once in the same JSON object"),
    (b'{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1, "lr": 2}}}',
     "optimizer.params.lr appears more than once"),
    (b"[1, 2]", "must hold a JSON object, got a list"),
    (b"", "is not valid JSON"),
    (b'{"train_batch_size": 8, "seed": "[[[[{{{{"}', None),  # brackets in strings do not nest
]


@pytest.mark.parametrize("content, phrase", BAD_FILES)
def test_check_config_reports_bad_files_without_a_traceback(content, phrase, tmp_path, capsys):
    file = tmp_path / "c.json"
    file.write_bytes(content)
    if phrase is None:
        assert cli_main(["check-config", str(file)]) == 0
        return
    assert cli_main(["check-config", str(file)]) == 1
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        parse_config(str(file), world_size=1)


def test_check_config_refuses_a_directory_and_bad_world_size(tmp_path, capsys, monkeypatch):
    assert cli_main(["check-config", str(tmp_path)]) == 1
    assert "is not a regular file" in capsys.readouterr().err
    file = tmp_path / "c.json"
    file.write_text(json.dumps(BASE))
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert cli_main(["check-config", str(file)]) == 1
    assert "$WORLD_SIZE must be a positive integer, got 'two'" in capsys.readouterr().err


def test_dict_config_accepts_numpy_scalars_as_numbers():
    cfg = {"train_batch_size": np.int64(8),
           "optimizer": {"type": "AdamW", "params": {"lr": np.float32(0.5),
                                                     "betas": (np.float64(0.9), 0.99)}},
           "zero_optimization": {"stage": np.int32(2),
                                 "zenflow": {"overlap_step": np.bool_(True),
                                             "update_interval": np.uint8(4)}}}
    raw = load_config_dict(cfg)
    json.dumps(raw)  # plain data: serializable, and storable in a weights-only checkpoint
    assert type(raw["train_batch_size"]) is int and type(raw["optimizer"]["params"]["lr"]) is float
    assert raw["optimizer"]["params"]["betas"] == [0.9, 0.99]
    parsed = parse_config(cfg, world_size=1)
    kw = optimizer_kwargs(parsed)
    assert kw["lr"] == 0.5 and kw["overlap_step"] is True and kw["update_interval"] == 4
    assert parsed.train_batch_size == 8 and parsed.zero_optimization.stage == 2


@pytest.mark.parametrize("value, path, phrase", [
    (torch.tensor(1e-3), "optimizer.params.lr", "is a Tensor (tensor(0.0010)); config values "
                                                "must be plain numbers"),
    (np.array([1e-3]), "optimizer.params.lr", "is a numpy.ndarray"),
    (object(), "optimizer.params.lr", "is a builtins.object"),
    (1 + 2j, "optimizer.params.lr", "is a builtins.complex"),
    ({1: 2}, "optimizer.params.lr", "has the key 1 of type int; config keys must be strings"),
])
def test_dict_config_refuses_tensors_and_objects(value, path, phrase):
    cfg = with_(optimizer={"type": "AdamW", "params": {"lr": value}})
    with pytest.raises(ConfigError) as err:
        parse_config(cfg, world_size=1)
    assert err.value.problems[0].startswith(path + " ") and phrase in err.value.problems[0]


def test_dict_config_nested_too_deeply_or_cyclic():
    deep = leaf = {}
    for _ in range(100):
        leaf["a"] = {}
        leaf = leaf["a"]
    with pytest.raises(ConfigError, match=r"^invalid config:\n  wandb(\.a)+ is nested more than "
                                          r"32 levels deep"):
        parse_config(with_(wandb=deep), world_size=1)
    cyclic = {"x": 1}
    cyclic["self"] = cyclic
    with pytest.raises(ConfigError, match="nested more than 32 levels deep"):
        parse_config(with_(tensorboard=cyclic), world_size=1)


def test_initialize_accepts_numpy_scalars_and_refuses_tensors_before_building(tmp_path):
    from zenflow.engine.engine import initialize

    from helpers.engine_toys import make_model

    cfg = {"train_batch_size": np.int64(8), "gradient_clipping": np.float32(1.0),
           "optimizer": {"type": "AdamW", "params": {"lr": np.float64(1e-2)}}}
    engine, optimizer, _, _ = initialize(model=make_model(), config=cfg)
    assert optimizer.param_groups[0]["lr"] == 1e-2 and engine.train_batch_size() == 8
    engine.save_checkpoint(tmp_path)  # the stored config is plain data: weights-only loadable
    engine.load_checkpoint(tmp_path)
    engine.close()
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    bad = dict(cfg, optimizer={"type": "AdamW", "params": {"lr": torch.tensor(1e-2)}})
    with pytest.raises(ConfigError, match=r"optimizer.params.lr is a Tensor"):
        initialize(model=model, config=bad)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_huge_select_interval_means_never_reselect_and_is_accepted():
    step = {"select_strategy": "step"}
    cfg = parse_config(with_(zero_optimization={"zenflow": {**step, "select_interval": 10**6}}),
                       world_size=1)
    assert optimizer_kwargs(cfg)["select_interval"] == 10**6
    with pytest.raises(ConfigError, match='select_interval must be "auto" or an integer '
                                          '<= 1000000000, got 10000000000'):
        parse_config(with_(zero_optimization={"zenflow": {**step, "select_interval": 10**10}}),
                     world_size=1)


def test_zenflow_block_sets_the_window_options():
    z = ZenFlowSection(deferred_credit="window", install_lookahead=0.5)
    settings = z.settings(max_grad_norm=None)
    assert settings.deferred_credit == "window" and settings.install_lookahead == 0.5
    with pytest.raises(ValueError, match="deferred_credit"):
        ZenFlowSection(deferred_credit="sum")


def test_check_config_json_reports_an_invalid_config_as_json(tmp_path, capsys):
    file = tmp_path / "bad.json"
    file.write_text(json.dumps({"train_batch_size": 8, "bogus": 1}))
    assert cli_main(["check-config", str(file), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report == {"file": str(file), "valid": False, "errors": ["bogus is not a known key"]}


def test_check_config_takes_a_hugging_face_trainer_config_with_its_auto_values(tmp_path, capsys):
    file = tmp_path / "hf.json"
    file.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "zenflow": {"topk_ratio": 0.05, "update_interval": "auto"}}}))
    assert cli_main(["check-config", str(file)]) == 1          # outside a Trainer: refused
    capsys.readouterr()
    assert cli_main(["check-config", str(file), "--hf-trainer", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["optimizer"] == "zenflow.ZenFlowAdamW"
    assert report["optimizer_kwargs"]["topk_ratio"] == 0.05
    assert report["filled_by_the_trainer"] == [
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay"]
