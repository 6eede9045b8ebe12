"""`zenflow check-config FILE`: validate a DeepSpeed-style config and print what will run."""
from __future__ import annotations

import argparse
import json
import sys

from zenflow.config.deepspeed_json import ConfigError, parse_config, resolved_settings
from zenflow.optim.selection_schedule import SelectionSchedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="path to the JSON config")
    parser.add_argument("--world-size", type=int, default=None,
                        help="data-parallel world size for the batch-size rule "
                             "(default: $WORLD_SIZE or 1)")
    parser.add_argument("--json", action="store_true", help="print the resolved settings as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = parse_config(args.file, world_size=args.world_size)
    except ConfigError as exc:
        print(f"{args.file}: invalid config", file=sys.stderr)
        for problem in exc.problems:
            print(f"  error: {problem}", file=sys.stderr)
        return 1
    if cfg.zenflow is not None:
        # The optimizer's own selection rule, as initialize applies it (select_strategy "epoch"
        # needs an epoch length; initialize takes it from training_data when one is passed).
        try:
            SelectionSchedule.for_settings(cfg.zenflow_settings(), "zero_optimization.zenflow")
        except ValueError as exc:
            print(f"{args.file}: invalid config", file=sys.stderr)
            print(f"  error: {exc} (initialize can take it from training_data; without that, "
                  "set zero_optimization.zenflow.steps_per_epoch)", file=sys.stderr)
            return 1
    settings = resolved_settings(cfg)
    if args.json:
        print(json.dumps(settings, indent=2, default=str))
        return 0
    print(f"{args.file}: valid. What will run:")
    for key, value in settings.items():
        if isinstance(value, dict):
            print(f"  {key}:")
            for k, v in value.items():
                print(f"    {k}: {v}")
        elif key == "ignored_keys":
            print(f"  {key} (accepted, no effect here): {', '.join(value) if value else '(none)'}")
        else:
            print(f"  {key}: {value}")
    return 0
