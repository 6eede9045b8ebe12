"""The `zenflow` command (also `python -m zenflow`). Each subcommand lives in its own module,
imported only when used; a module provides add_arguments(parser), run(args) -> int and, when it
needs optional packages, required_modules(args) -> import names, checked before any work. A
command's module imports torch inside run(), never at its top, so that --help is instant
(tests/test_cli.py checks it)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help).
SUBCOMMANDS = {
    "check-config": ("zenflow.tools.check_config",
                     "validate a DeepSpeed-style JSON config and print what will run"),
    "bench": ("zenflow.tools.bench.cli",
              "side-by-side step-time benchmark against AdamW, ZeRO-Offload and DeepSpeed"),
    "finetune": ("zenflow.tools.finetune.cli", "fine-tune a model on a text task with ZenFlow"),
    "selftest": ("zenflow.tools.selftest_cli",
                 "check correctness on this machine and measure host and bus speed"),
    "estimate": ("zenflow.tools.estimate_cli",
                 "memory, bus traffic and step time of AdamW, ZeRO-Offload and ZenFlow for a model"),
    "launch": ("zenflow.tools.launch",
               "run a DeepSpeed script unchanged (DeepSpeed's launcher options, over torchrun)"),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DESCRIPTION = ("ZenFlow's command-line tools (also `python -m zenflow`): check a DeepSpeed config, "
               "launch a DeepSpeed script, benchmark, fine-tune, self-test and estimate.")
EPILOG = "Run `zenflow COMMAND --help` for the options of one command."


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says what it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        shown = "not set" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("zenflow-torch")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


def _add_logging_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="more log output: -v for INFO, -vv for DEBUG")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                       help="log level of the zenflow loggers (overrides -v; WARNING without "
                            "either)")


def _log_level(*parsed: argparse.Namespace) -> int:
    for ns in parsed:
        if getattr(ns, "log_level", None):
            return getattr(logging, ns.log_level)
    verbose = sum(getattr(ns, "verbose", 0) for ns in parsed)
    return logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zenflow", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"zenflow {_version()}")
    _add_logging_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # -h/--help belongs to the subcommand's own parser, built below once we know which it is.
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(_module=module_name)
    # Parse the command name first, then let the chosen module declare its own arguments.
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(args._module)
    cmd_parser = argparse.ArgumentParser(prog=f"zenflow {args.command}",
                                         description=SUBCOMMANDS[args.command][1],
                                         formatter_class=DefaultsHelpFormatter)
    module.add_arguments(cmd_parser)
    _add_logging_options(cmd_parser)
    cmd_args = cmd_parser.parse_args(rest)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("zenflow").setLevel(_log_level(cmd_args, args))
    required = getattr(module, "required_modules", None)
    if required is not None:
        from zenflow.tools.optional_deps import MissingDependency, require
        try:
            require(f"zenflow {args.command}", required(cmd_args))
        except MissingDependency as exc:
            print(f"zenflow {args.command}: error: {exc}", file=sys.stderr)
            return 2
    return int(module.run(cmd_args) or 0)


if __name__ == "__main__":
    sys.exit(main())
