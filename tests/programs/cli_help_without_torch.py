"""tests/test_cli.py's child: asks for `zenflow --help` and every `zenflow COMMAND --help`, and
prints each one's argv and whether torch was imported by then."""
import contextlib
import io
import sys

from zenflow.tools.cli import SUBCOMMANDS, main

for argv in [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    assert out.getvalue().startswith("usage: zenflow"), (argv, out.getvalue()[:200])
    print(" ".join(argv), "torch" in sys.modules)
