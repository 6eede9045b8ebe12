"""Child processes: the programs under tests/programs/ and the environment they run in."""
from __future__ import annotations

import os
import signal
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
PROGRAMS = TESTS / "programs"


def program(name: str) -> Path:
    """The path of tests/programs/NAME, to run as `python PATH ...`."""
    path = PROGRAMS / name
    assert path.is_file(), f"no program {path}"
    return path


def with_root_on_path(env: dict | None = None, **extra: str) -> dict:
    """os.environ (or `env`) with this checkout first on PYTHONPATH: a child imports the zenflow
    the tests import, as `python -c` run from the checkout did."""
    env = dict(os.environ if env is None else env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def sigint_as_in_a_terminal():
    """A child process's preexec_fn: SIGINT back to its default, so that the child's Python
    installs its KeyboardInterrupt handler even when this run started with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
