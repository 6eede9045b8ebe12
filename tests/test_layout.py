"""The package's imports run one way: from the data path's lowest layer (settings) up to the tools.

A module may import only from its own layer or the layers below it, including imports inside
functions, so that a newcomer can read the tree bottom-up and a change low down never needs
a change higher up to import. `zenflow/__init__.py` (the public names) may import anything.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.children import program, with_root_on_path

PACKAGE = Path(__file__).resolve().parent.parent / "zenflow"

# Lowest first. A module belongs to the first layer whose prefix it has.
LAYERS = [
    ("config",),                                  # settings and rules, torch-free
    ("adamw", "saved_state", "distributed"),      # arithmetic and collectives both sides share
    ("host",),                                    # the other side of the bus
    ("optim",),                                   # the optimizers' step()
    ("compat",),                                  # names DeepSpeed clients import
    ("engine",),                                  # zenflow.initialize and the engine
    ("integrations",),                            # Trainer, Lightning, Accelerate
    ("tools",),                                   # the `zenflow` command; never imported below
]


def layer(module: str) -> int:
    """The layer of a dotted module name relative to zenflow ("host.pipeline" -> 2)."""
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"zenflow.{module} belongs to no layer: add it to LAYERS")


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"
                  and p != PACKAGE / "__init__.py")


def dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def zenflow_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module relative to zenflow) of every import of the package in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from zenflow.x import y`: y may be a module; its layer is x's or below.
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.module == "zenflow":   # a subpackage, or a public name (the top)
                names = [f"zenflow.{a.name}" if (PACKAGE / a.name).exists() or
                         (PACKAGE / f"{a.name}.py").exists() else "zenflow.tools" for a in node.names]
        else:
            continue
        for name in names:
            if name == "zenflow":
                name = "zenflow.tools"   # `import zenflow`: the public names, the top layer
            if name.startswith("zenflow."):
                out.append((node.lineno, name.removeprefix("zenflow.")))
    return out


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    here = dotted(path)
    own = layer(here)
    for line, imported in zenflow_imports(path):
        assert layer(imported) <= own, (
            f"zenflow/{path.relative_to(PACKAGE)}:{line} imports zenflow.{imported}, a higher "
            f"layer ({LAYERS[layer(imported)][0]}) than its own ({LAYERS[own][0]})")


def test_config_is_importable_without_torch():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(program("config_imports_no_torch.py"))],
                         capture_output=True, text=True, cwd=PACKAGE.parent, timeout=60,
                         env=with_root_on_path())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing the config pulled in torch"


def test_no_import_cycles_between_modules():
    graph = {dotted(p): {m for _, m in zenflow_imports(p)} for p in modules()}
    graph = {k: {m for m in v if m in graph and m != k} for k, v in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_the_tree_is_clean_under_ruff():
    import subprocess
    import sys
    pytest.importorskip("ruff")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."],
                         capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


# A module a newcomer reads in one sitting, a class that does one job (issue 34's limits).
MODULE_LINES, CLASS_LINES = 400, 300


def test_no_module_or_class_is_too_long_to_read_in_one_sitting():
    too_long = []
    for path in modules():
        text = path.read_text()
        name = path.relative_to(PACKAGE)
        if len(text.splitlines()) > MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    too_long.append(f"{name}: class {node.name}, {lines} lines "
                                    f"(at most {CLASS_LINES})")
    assert not too_long, "\n".join(too_long)
