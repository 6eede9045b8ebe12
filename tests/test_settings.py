"""One settings object: the constructor's keywords, the JSON block and the defaults agree."""
import functools
import inspect
import operator
import types
import typing

import pytest
import torch

import zenflow
from zenflow.config.deepspeed_json import ZenFlowSection, optimizer_kwargs, parse_config
from zenflow.config.settings import (
    ADAMW_DEFAULTS,
    DEFAULTS,
    IGNORED_TORCH_FLAGS,
    UNSUPPORTED_TORCH_FLAGS,
    AdamWHyperparameters,
    ZenFlowSettings,
)

TORCH_FLAGS = {*IGNORED_TORCH_FLAGS, *UNSUPPORTED_TORCH_FLAGS}


def without_rules(annotation):
    """A settings field's type with its validation rule (Annotated metadata) taken off."""
    if typing.get_origin(annotation) is typing.Annotated:
        return without_rules(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, map(without_rules, typing.get_args(annotation)))
    return annotation


def test_constructor_keywords_are_the_settings_fields_with_their_defaults_and_types():
    signature = inspect.signature(zenflow.ZenFlowAdamW.__init__).parameters
    keyword_only = {name for name, p in signature.items() if p.kind is p.KEYWORD_ONLY}
    assert not any(p.kind is p.VAR_KEYWORD for p in signature.values()), \
        "a **kwargs would hide a misspelt knob from type checkers"
    assert keyword_only - {"process_group"} - TORCH_FLAGS == set(ZenFlowSettings.model_fields)
    assert {name: signature[name].default for name in ZenFlowSettings.model_fields} == \
        DEFAULTS.model_dump()
    hints = typing.get_type_hints(zenflow.ZenFlowAdamW.__init__)
    for name, field in ZenFlowSettings.model_fields.items():
        assert hints[name] == without_rules(field.annotation), name
    adamw = {name: signature[name].default for name in AdamWHyperparameters.model_fields}
    assert adamw == ADAMW_DEFAULTS.model_dump()
    offload = inspect.signature(zenflow.OffloadAdamW.__init__).parameters
    assert {name: offload[name].default for name in adamw} == adamw
    torch_adamw = inspect.signature(torch.optim.AdamW.__init__).parameters
    for name in TORCH_FLAGS:   # as torch.optim.AdamW takes them: the same kind and default
        for ours in (signature, offload):
            assert (ours[name].kind, ours[name].default) == \
                (torch_adamw[name].kind, torch_adamw[name].default), name


def test_a_misspelt_argument_is_refused_naming_the_closest_one():
    params = torch.nn.Linear(4, 3).parameters()
    with pytest.raises(TypeError, match=r"ZenFlowAdamW: topk_rato=0\.2 is not one of its "
                                        r"arguments; did you mean topk_ratio\?"):
        zenflow.ZenFlowAdamW(params, topk_rato=0.2, worker=False)
    with pytest.raises(TypeError, match="weight_decy=0.1 is not one of its arguments; did you "
                                        "mean weight_decay?"):
        zenflow.ZenFlowAdamW(params, weight_decy=0.1, worker=False)
    with pytest.raises(TypeError, match="OffloadAdamW: max_grad_nrom=1.0 .* did you mean "
                                        "max_grad_norm?"):
        zenflow.OffloadAdamW(params, max_grad_nrom=1.0)
    with pytest.raises(TypeError, match=r"OffloadAdamW: topk_ratio=0\.1 is not one of its "
                                        r"arguments: OffloadAdamW fixes that ZenFlow knob"):
        zenflow.OffloadAdamW(params, topk_ratio=0.1)
    with pytest.raises(TypeError, match="bogus=1 is not one of its arguments; its arguments: "
                                        "params, lr, betas"):
        zenflow.ZenFlowAdamW(params, bogus=1, worker=False)


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_torch_adamw_flags_run_as_written_or_are_refused_with_the_reason(cls):
    model = torch.nn.Linear(4, 3)
    as_torch = dict(fused=True, foreach=False, maximize=False, capturable=False,
                    differentiable=False)
    opt = cls(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.01, False, worker=False, **as_torch)
    plain = cls(model.parameters(), worker=False)
    assert opt.settings == plain.settings   # foreach and fused change nothing
    opt.close()
    plain.close()
    for name, why in UNSUPPORTED_TORCH_FLAGS.items():
        with pytest.raises(ValueError) as refused:
            cls(model.parameters(), worker=False, **{name: True})
        assert str(refused.value) == (f"{cls.__name__}: {name}=True is not supported: {why}; "
                                      f"pass {name}=False or leave it out")
        with pytest.raises(TypeError, match=f"{name} must be False .* got 'no'"):
            cls(model.parameters(), worker=False, **{name: "no"})
    with pytest.raises(TypeError, match="fused must be True, False or None .* got 'yes'"):
        cls(model.parameters(), worker=False, fused="yes")


def test_repr_shows_the_settings_and_the_groups():
    opt = zenflow.ZenFlowAdamW(torch.nn.Linear(4, 3).parameters(), lr=0.5, topk_ratio=0.25,
                               worker=False)
    text = repr(opt)
    opt.close()
    assert text.startswith("ZenFlowAdamW (\nZenFlow settings\n    topk_ratio: 0.25\n")
    for name, value in opt.settings.model_dump().items():
        assert f"\n    {name}: {value!r}\n" in text, name
    assert "\nParameter Group 0\n" in text and "\n    lr: 0.5\n" in text
    assert text.index("ZenFlow settings") < text.index("Parameter Group 0")


# That a type checker sees the knobs (mypy on a client of the installed wheel):
# tests/test_cli.py::test_built_wheel_installs_into_a_fresh_venv_offline.


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
