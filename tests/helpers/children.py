"""Child processes: the programs under tests/programs/ and the environment they run in."""
from __future__ import annotations

import os
import signal
import subprocess
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


def run_child(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True), except that a child still running
    at `timeout` is not killed blind: it gets SIGABRT, on which Python's faulthandler (enabled
    here for it) prints every thread's stack, and the test fails showing them, so that a hang
    seen once (in CI, say) says where it hung."""
    env = dict(kw.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1")
    feed = kw.pop("input", None)
    stdin = subprocess.PIPE if feed is not None else kw.pop("stdin", None)
    with subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, **kw) as child:
        try:
            out, err = child.communicate(feed, timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            try:
                out, err = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
            raise AssertionError(f"{argv[:3]} ran past {timeout:g} s; its threads then:\n"
                                 f"{err[-6000:]}") from None
    return subprocess.CompletedProcess(argv, child.returncode, out, err)
