"""Config machinery: dataclass configs, TOML recipes and dotted command-line overrides.

Each component owns a small config dataclass (``@dataclass(kw_only=True, slots=True)``, a
docstring per field, checks in ``__post_init__`` raising ``ValueError``). A recipe is a TOML file
whose tables are those sections; ``etude pretrain configs/pretrain-tiny.toml optim.lr=0.01`` applies
dotted overrides on top. Unknown keys and wrong types are errors that name the key and the fix.

This module imports no torch, so configs can be read and checked without it.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _type_ok(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits annotation ``tp`` (the subset of typing our configs use)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            return False
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(_type_ok(v, a) for v, a in zip(value, args))
        return not args or all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build config dataclass ``cls`` from a (TOML-shaped) dict, checking keys and types.

    Nested dataclass fields take nested tables. ``where`` is the dotted path used in errors.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ValueError(
            f"unknown config key {name!r}; valid keys{' of ' + where if where else ''}: "
            f"{', '.join(sorted(fields))}"
        )
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, path)
            continue
        if isinstance(value, list) and typing.get_origin(tp) is tuple:
            value = tuple(value)
        if not _type_ok(value, tp):
            raise ValueError(f"config key {path!r} must be {_type_name(tp)}, got {value!r}")
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field with no value
        raise ValueError(f"{where or cls.__name__}: {e}") from None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain data (tuples become lists), for TOML/JSON output."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"optim.lr=0.01"`` -> (["optim", "lr"], 0.01); values parse as TOML, else as strings."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.key=value (e.g. optim.lr=0.01)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {item!r} has an empty key; write section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys on a nested dict (a copy); intermediate tables are created as needed."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is a value, not a table")
        node[parts[-1]] = value
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML recipe; a missing or malformed file is a ``ValueError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"config file {str(path)!r} does not exist; pass a recipe such as configs/demo.toml"
        )
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Recipe file (optional) + dotted overrides -> a checked ``cls`` instance."""
    data = load_toml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, list(overrides)))
