"""Reading a DeepSpeed-style config into plain JSON data, and pydantic's errors into key paths.

Whatever is given, a file or a dict, comes out as a fresh tree of dicts, lists, strings,
numbers, booleans and None, or as a ConfigError whose lines each name the key path, the value
and what is allowed. A file must be UTF-8 JSON with no duplicate keys (DeepSpeed refuses them
too) nested at most MAX_DEPTH levels; a dict may hold numpy scalars (converted to numbers) but
not tensors or other objects. No torch import here: `zenflow check-config` stays light.
"""
from __future__ import annotations

import json
import numbers
import os
import re
from pathlib import Path
from typing import Any

from zenflow.config.rules import ERROR_TYPE as RULE_ERROR

MAX_DEPTH = 32                # a DeepSpeed config is 4 levels deep
MAX_FILE_BYTES = 16 * 2**20   # a DeepSpeed config is a few kB
_MAX_LINE = 300


class ConfigError(ValueError):
    """A config that cannot run. `problems` holds one `key.path message` string per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [p if len(p) <= _MAX_LINE else p[:_MAX_LINE] + "..." for p in problems]
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


def _key(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return path if path else "the config"


class _Pairs(list):
    """A JSON object as the parser saw it, duplicates included (json's object_pairs_hook)."""


def _plain(value: Any, path: str, depth: int, problems: list[str]) -> Any:
    """A copy of `value` as plain JSON data; each value that is not becomes a problem line."""
    if depth > MAX_DEPTH:
        problems.append(f"{_where(path)} is nested more than {MAX_DEPTH} levels deep; a "
                        f"DeepSpeed config is a few levels of objects")
        return None
    if isinstance(value, _Pairs):
        out, seen = {}, set()
        for key, item in value:
            if key in seen:
                problems.append(f"{_key(path, key)} appears more than once in the same JSON "
                                f"object; keep one (DeepSpeed refuses duplicate keys too)")
            seen.add(key)
            out[key] = _plain(item, _key(path, key), depth + 1, problems)
        return out
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{_where(path)} has the key {key!r:.80} of type "
                                f"{type(key).__name__}; config keys must be strings")
                continue
            out[key] = _plain(item, _key(path, key), depth + 1, problems)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, _key(path, i), depth + 1, problems) for i, item in enumerate(value)]
    if value is None or isinstance(value, (str, bool)):
        return value
    module = type(value).__module__.split(".")[0]
    if module == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, numbers.Integral) and module in ("builtins", "numpy"):
        return int(value)
    if isinstance(value, numbers.Real) and module in ("builtins", "numpy", "fractions"):
        return float(value)
    if module == "torch":
        problems.append(f"{_where(path)} is a {type(value).__name__} ({value!r:.60}); config "
                        f"values must be plain numbers, strings, lists or objects (use .item() "
                        f"for a one-element tensor)")
    else:
        problems.append(f"{_where(path)} is a {module}.{type(value).__qualname__} ({value!r:.60}), "
                        f"which is not JSON data; allowed: numbers, strings, true/false, null, "
                        f"lists and objects")
    return None


def plain_data(value: Any) -> Any:
    problems: list[str] = []
    out = _plain(value, "", 0, problems)
    if problems:
        raise ConfigError(problems)
    return out


# The first character of JSON text in UTF-16 or UTF-32 (either byte order), without a BOM.
_WIDE = re.compile(rb"\x00{1,3}[{\[\s]|[{\[\s]\x00{1,3}")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _nesting(text: str) -> int:
    """How deep objects and lists nest in JSON text (brackets inside strings do not count),
    found without recursion so that absurd nesting cannot exhaust the stack."""
    depth = deepest = 0
    for ch in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _decode(name: str, raw: bytes) -> str:
    if raw.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")) or _WIDE.match(raw):
        raise ConfigError([f"config file {name} is UTF-16 or UTF-32 text; save it as UTF-8 "
                           f"(JSON files are UTF-8)"])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file {name} is not UTF-8 text: byte 0x{raw[exc.start]:02x} "
                           f"at offset {exc.start} (a binary file, or text saved as latin-1 or "
                           f"another code page); save it as UTF-8 JSON"]) from None


def read_json_file(path: Path) -> dict:
    name = repr(str(path))
    if not path.exists():
        raise ConfigError([f"config file {name} does not exist"])
    if not path.is_file():
        raise ConfigError([f"config file {name} is not a regular file"])
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError([f"config file {name} has {size} bytes; a DeepSpeed config is a "
                               f"few kB (at most {MAX_FILE_BYTES} bytes are read)"])
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"config file {name} cannot be read: {exc.strerror or exc}"]) from None
    text = _decode(name, raw)
    deepest = _nesting(text)
    if deepest > MAX_DEPTH:
        raise ConfigError([f"config file {name} nests objects and lists {deepest} levels deep; "
                           f"at most {MAX_DEPTH} are allowed (a DeepSpeed config has about 4)"])
    try:
        data = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"config file {name} is not valid JSON: {exc}"]) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        raise ConfigError([f"config file {name} is not valid JSON: {exc}"]) from None
    if not isinstance(data, _Pairs):
        raise ConfigError([f"config file {name} must hold a JSON object, got "
                           f"{'a list' if isinstance(data, list) else repr(data)[:60]}"])
    return plain_data(data)


def load_config_dict(config: str | os.PathLike | dict) -> dict:
    """A config given as a path to a JSON file or as a dict, as a fresh tree of plain data."""
    if isinstance(config, dict):
        return plain_data(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError([f"config must be a path to a JSON file or a dict, got "
                           f"{type(config).__name__}"])
    return read_json_file(Path(config))


# ---------------------------------------------------------------------------------------------
# Turning pydantic's errors into `key.path message, got value` lines.

_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
               "string": "a string", "dict": "an object", "model": "an object",
               "tuple": "a list", "list": "a list"}


def _path(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and (p.startswith("function-") or p.startswith("literal[")):
            continue  # labels of a validator or union branch, not keys
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _describe(err: dict) -> tuple[str, str]:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    path = _path(err["loc"])
    if kind == RULE_ERROR:  # a broken zenflow.config.rules rule, in JSON's words
        return path + err["ctx"]["where"], err["ctx"]["json"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if msg.startswith("@"):  # a model-level check naming its own key, relative to the model
            key, _, rest = msg[1:].partition(" ")
            return (f"{path}.{key}" if path else key), rest
        return path, msg
    if kind == "extra_forbidden":
        return path, "is not a known key"
    if kind == "missing":
        return path, "is required but missing"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        word = _TYPE_WORDS.get(kind.split("_")[0], kind.split("_")[0])
        return path, f"must be {word}, got {value!r:.100}"
    if kind == "literal_error":
        return path, f"must be one of {err['ctx']['expected']}, got {value!r:.100}"
    return path, f"{msg[0].lower()}{msg[1:]}, got {value!r:.100}"


def validation_problems(exc) -> list[str]:
    """One `key.path message` line per error of a pydantic ValidationError."""
    out = []
    for err in exc.errors():
        path, msg = _describe(err)
        line = f"{path} {msg}" if path else msg
        if line not in out:
            out.append(line)
    return out
