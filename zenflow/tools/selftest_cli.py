"""The `zenflow selftest` command: its arguments and its run. Importing this module imports no
torch (`zenflow selftest --help` is instant); run() imports the checks (selftest.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from zenflow.tools.selftest_sections import DTYPES, SECTIONS


def _row(section: str, c) -> str:
    """One printed line: a check (zenflow.tools.selftest_checks.Check) of a section."""
    mark = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[c.status]
    return f"{section:<13} {c.name:<52} {mark:<5} {c.seconds:6.2f}s  {c.detail}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="device to check (default: cuda:0 when CUDA is available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="parameter dtype of the correctness checks")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of the sections to run (default: all)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the full report as JSON (for bug reports and for "
                             "`zenflow estimate --selftest-json`)")


def run(args: argparse.Namespace) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        print(f"zenflow selftest: error: --sections: unknown {unknown or 'empty list'}; choose "
              f"from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    print(f"{'section':<13} {'check':<52} {'result':<5} {'time':>7}  measured / detail", flush=True)
    from zenflow.tools.selftest import run_selftest
    try:
        report = run_selftest(args.device, args.dtype, sections=sections,
                              echo=lambda s, c: print(_row(s, c), flush=True))
    except ValueError as exc:
        print(f"zenflow selftest: error: {exc}", file=sys.stderr)
        return 2
    failed = [f"{s}: {c['name']}" for s, sec in report["sections"].items()
              for c in sec["checks"] if c["status"] == "fail"]
    print(f"\n{'PASSED' if report['passed'] else 'FAILED'} on {report['device']} "
          f"({report['dtype']}) in {report['seconds']:.1f} s"
          + (f"; failed: {'; '.join(failed)}" if failed else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if report["passed"] else 1
