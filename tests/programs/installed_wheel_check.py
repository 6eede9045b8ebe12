"""tests/test_cli.py's check inside the fresh virtual environment VENV that the built wheel went
into: zenflow comes from VENV, ships py.typed, and its version is the distribution's. Prints it.

    VENV/bin/python tests/programs/installed_wheel_check.py VENV
"""
import importlib.metadata as m
import importlib.resources as r
import sys

import zenflow
import zenflow.integrations  # noqa: F401

venv = sys.argv[1]
assert zenflow.__file__.startswith(venv), zenflow.__file__
assert r.files('zenflow').joinpath('py.typed').is_file()
assert zenflow.__version__ == m.version('zenflow-torch')
print(zenflow.__version__)
