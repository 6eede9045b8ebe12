"""The `zenflow` command. Each subcommand lives in its own module, imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). A module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "check-config": ("zenflow.config_check", "validate a DeepSpeed-style JSON config and print what will run"),
    "bench": ("zenflow.bench.cli", "side-by-side step-time benchmark against AdamW, ZeRO-Offload and DeepSpeed"),
    "finetune": ("zenflow.finetune.cli", "fine-tune a model on a text task with ZenFlow"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zenflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # -h/--help belongs to the subcommand's own parser, built below once we know which it is.
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(_module=module_name)
    # Parse the command name first, then let the chosen module declare its own arguments.
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(args._module)
    cmd_parser = argparse.ArgumentParser(prog=f"zenflow {args.command}",
                                         description=SUBCOMMANDS[args.command][1])
    module.add_arguments(cmd_parser)
    return int(module.run(cmd_parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
