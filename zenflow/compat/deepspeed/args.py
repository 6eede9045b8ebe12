"""`deepspeed.add_config_arguments`: the command-line options DeepSpeed scripts parse."""
from __future__ import annotations

import argparse
from typing import Any


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's --deepspeed and --deepspeed_config options (and the deprecated
    --deepscale spellings) to `parser`; `initialize(args=...)` reads args.deepspeed_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-style configuration (zenflow)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (a flag for user code; zenflow does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="path to the DeepSpeed JSON config (read by zenflow.initialize)")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser


def config_from_arguments(config: Any, config_params: Any, args: Any) -> Any:
    """The one config source among initialize's `config`, `config_params` (DeepSpeed's older
    name) and `args.deepspeed_config` (or the deprecated `args.deepscale_config`). Two sources
    are an error, as in DeepSpeed: silently preferring one would train with a config the user
    did not mean."""
    sources = {}
    if config is not None:
        sources["config="] = config
    if config_params is not None:
        sources["config_params="] = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None) if args is not None else None
        if value is not None:
            sources[f"args.{name}"] = value
    if len(sources) > 1:
        raise ValueError(f"initialize: the config is given {len(sources)} times "
                         f"({', '.join(sources)}); give exactly one")
    if not sources:
        raise ValueError("initialize: no config: pass config= (a path to the JSON file or a "
                         "dict) or args with --deepspeed_config (see add_config_arguments)")
    return next(iter(sources.values()))
