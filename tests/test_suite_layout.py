"""The suite's own layout, which a newcomer relies on: shared code lives in tests/helpers/ and is
imported from there (never from another test file or from conftest.py, which holds fixtures only);
the programs the tests run as child processes are files in tests/programs/, each used by a test,
none named like a module it would shadow (a script's directory comes first on its sys.path)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PROGRAMS = TESTS / "programs"
SOURCES = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_shared_code_comes_from_helpers(path):
    for line, module in imported_modules(path):
        top = module.split(".")[0]
        assert top not in ("conftest", "tests") and not top.startswith("test_"), (
            f"tests/{path.relative_to(TESTS)}:{line} imports {module}: move what it needs to "
            "tests/helpers/ and import it from there")


def test_every_program_is_run_by_a_test_and_shadows_no_module():
    programs = sorted(PROGRAMS.glob("*.py"))
    assert programs
    text = "\n".join(p.read_text() for p in SOURCES if PROGRAMS not in p.parents)
    for program in programs:
        assert f'"{program.name}"' in text, f"tests/programs/{program.name} is run by no test"
        assert importlib.util.find_spec(program.stem) is None, (
            f"tests/programs/{program.name} has the name of an importable module")
