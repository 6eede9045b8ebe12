"""One settings object: the constructor's keywords, the JSON block and the defaults agree."""
import inspect

import pytest

import zenflow
from zenflow.config.deepspeed_json import ZenFlowSection, optimizer_kwargs, parse_config
from zenflow.config.settings import ADAMW_DEFAULTS, DEFAULTS, AdamWHyperparameters, ZenFlowSettings


def test_constructor_keywords_are_the_settings_fields_with_their_defaults():
    signature = inspect.signature(zenflow.ZenFlowAdamW.__init__).parameters
    knobs = {name: p.default for name, p in signature.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "process_group"}
    assert knobs == DEFAULTS.model_dump()
    adamw = {name: signature[name].default for name in AdamWHyperparameters.model_fields}
    assert adamw == ADAMW_DEFAULTS.model_dump()
    offload = inspect.signature(zenflow.OffloadAdamW.__init__).parameters
    assert {name: offload[name].default for name in adamw} == adamw


def test_optimizer_keeps_its_validated_settings():
    import torch
    opt = zenflow.ZenFlowAdamW(torch.nn.Linear(4, 3).parameters(), topk_ratio=0.5,
                               update_interval="auto", worker=False)
    assert opt.settings == DEFAULTS.replace(topk_ratio=0.5, update_interval="auto", worker=False)
    opt.close()


def test_json_block_keys_are_settings_fields_with_deepspeed_defaults():
    # A DeepSpeed config trains as under DeepSpeed: only these three defaults are DeepSpeed's
    # own (update_interval is "auto" in both; ours has no importance threshold, auto_ratio=None;
    # ours reselects on drift, DeepSpeed's "auto" once per epoch).
    block = ZenFlowSection().settings(max_grad_norm=None)
    differ = {k for k, v in block.model_dump().items() if v != getattr(DEFAULTS, k)}
    assert differ == {"auto_ratio", "overlap_step", "select_strategy"}
    assert block.select_strategy == "auto" and DEFAULTS.select_strategy == "drift"
    assert set(ZenFlowSection.model_fields) - {"offload"} <= set(ZenFlowSettings.model_fields)


def test_config_builds_the_settings_its_kwargs_show():
    cfg = parse_config({"train_batch_size": 8, "gradient_clipping": 2.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "zero_optimization": {"zenflow": {"topk_ratio": 0.2,
                                                          "update_interval": 3}}}, world_size=1)
    settings = cfg.zenflow_settings()
    assert settings == DEFAULTS.replace(topk_ratio=0.2, update_interval=3, overlap_step=False,
                                        select_strategy="auto", select_interval="auto",
                                        max_grad_norm=2.0, auto_ratio=0.99)
    kwargs = optimizer_kwargs(cfg)
    assert all(kwargs[k] == getattr(settings, k) for k in kwargs if k in ZenFlowSettings.model_fields)
    assert kwargs["lr"] == 1e-2 and kwargs["weight_decay"] == 0.0   # DeepSpeed's default


@pytest.mark.parametrize("changes, error, message", [
    (dict(topk_ratio=2), ValueError, "ZenFlowSettings: topk_ratio must be between 0.0 and 1.0"),
    (dict(bogus=1), TypeError, "ZenFlowSettings: bogus is not one of its settings"),
    (dict(auto_update_bounds=(1, "x")), TypeError,
     r"auto_update_bounds\[1\] must be an integer >= 1, got 'x'"),
])
def test_replace_validates(changes, error, message):
    with pytest.raises(error, match=message):
        DEFAULTS.replace(**changes)


def test_settings_are_immutable():
    with pytest.raises(Exception):
        DEFAULTS.topk_ratio = 0.5
