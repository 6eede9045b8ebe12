"""`zenflow check-config FILE`: validate a DeepSpeed-style config and print what will run.

`--hf-trainer` checks a config written for the Hugging Face Trainer, whose "auto" values the
Trainer fills in from its TrainingArguments: they are listed as filled by the Trainer and the
rest is checked as it stands (without the flag, such a value outside a Trainer is an error).
"""
from __future__ import annotations

import argparse
import json
import sys

from zenflow.config.deepspeed_json import ConfigError, parse_config, resolved_settings
from zenflow.config.loading import load_config_dict
from zenflow.optim.selection_schedule import SelectionSchedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="path to the JSON config")
    parser.add_argument("--world-size", type=int, default=None,
                        help="data-parallel world size for the batch-size rule "
                             "(default: $WORLD_SIZE or 1)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON, for a valid config and an invalid one")
    parser.add_argument("--hf-trainer", action="store_true",
                        help='the config is for the Hugging Face Trainer: its "auto" values are '
                             "the Trainer's to fill in")


def trainer_filled(config: dict, path: str = "") -> tuple[dict, list[str]]:
    """`config` without its "auto" values outside zero_optimization (where "auto" is a value of
    ours), and the key paths taken out: what the Hugging Face Trainer fills in."""
    kept, filled = {}, []
    for key, value in config.items():
        where = f"{path}{key}"
        if value == "auto" and not where.startswith("zero_optimization"):
            filled.append(where)
        elif isinstance(value, dict):
            kept[key], more = trainer_filled(value, f"{where}.")
            filled += more
        else:
            kept[key] = value
    return kept, filled


def run(args: argparse.Namespace) -> int:
    filled: list[str] = []
    try:
        config = load_config_dict(args.file)
        if args.hf_trainer:
            config, filled = trainer_filled(config)
            if filled and not any(k in config for k in ("train_batch_size",
                                                         "train_micro_batch_size_per_gpu")):
                config["train_micro_batch_size_per_gpu"] = 1   # the Trainer's per-device batch
        cfg = parse_config(config, world_size=args.world_size)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"file": args.file, "valid": False, "errors": exc.problems},
                             indent=2))
            return 1
        print(f"{args.file}: invalid config", file=sys.stderr)
        for problem in exc.problems:
            print(f"  error: {problem}", file=sys.stderr)
        return 1
    settings = resolved_settings(cfg)
    if cfg.zenflow is not None:
        # When the columns are chosen again, as the optimizer resolves select_strategy. Without
        # steps_per_epoch in the config, "epoch" and "auto" take the epoch length from
        # initialize's training_data; without that, they select once (and warn).
        schedule, warning = SelectionSchedule.resolve(cfg.zenflow_settings(),
                                                      "zero_optimization.zenflow")
        settings["column_selection"] = schedule.description + (
            "; initialize(training_data=...) gives the epoch length" if warning else "")
    if args.hf_trainer:
        settings["filled_by_the_trainer"] = filled
    if args.json:
        print(json.dumps({"file": args.file, "valid": True, **settings}, indent=2, default=str))
        return 0
    print(f"{args.file}: valid. What will run:")
    for key, value in settings.items():
        if isinstance(value, dict):
            print(f"  {key}:")
            for k, v in value.items():
                print(f"    {k}: {v}")
        elif key in ("ignored_keys", "filled_by_the_trainer"):
            what = "accepted, no effect here" if key == "ignored_keys" else "left to the Trainer"
            print(f"  {key} ({what}): {', '.join(value) if value else '(none)'}")
        else:
            print(f"  {key}: {value}")
    return 0
