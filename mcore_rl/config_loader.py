"""Typed config loading: nested dataclasses filled from YAML files and ``key.path=value`` overrides.

A schema is a (frozen or plain) ``@dataclass`` whose fields carry type hints; sections are
nested dataclasses. ``load_config`` reads a YAML file with ``yaml.safe_load``, applies
command-line overrides and builds the schema, checking every leaf against its annotation.
Any mistake raises ``ConfigError`` naming the dotted key path, the bad value and the fix.

Supported annotations: ``int`` (no bools, no floats), ``float`` (ints are converted),
``bool`` (real booleans only), ``str``, ``Optional[X]`` / ``X | None``, other unions,
``Literal[...]``, ``list[X]``, ``tuple[X, ...]`` / ``tuple[X, Y]``, ``dict[K, V]``,
nested dataclasses, ``Any``, and plain classes (checked with ``isinstance``).

YAML 1.1 reads ``1e-4`` (no dot) as a string; a float field accepts such a string.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml
from mcore_rl.errors import McoreRLError

__all__ = ["ConfigError", "load_config", "from_dict", "apply_override", "to_dict", "dump_yaml"]

T = TypeVar("T")

_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(McoreRLError, ValueError):
    """A config file, override or value does not fit the schema; the message says how to fix it."""


def _where(path: str) -> str:
    return path or "<top level>"


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "")


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _mismatch(path: str, tp: Any, value: Any, hint: str = "") -> ConfigError:
    return ConfigError(f"{_where(path)}: expected {_type_name(tp)}, got {_got(value)}{hint}")


def _init_fields(schema: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(schema) if f.init]


def _coerce_scalar(tp: type, value: Any, path: str) -> Any:
    """Check (and for float, convert) a leaf value against a plain class annotation."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _mismatch(path, tp, value, "; write true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        hint = "; ints only, write it without a fractional part" if isinstance(value, float) else ""
        raise _mismatch(path, tp, value, hint)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)
        raise _mismatch(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _mismatch(path, tp, value, f"; quote it in YAML: '{value}'")
    if isinstance(value, tp):
        return value
    raise _mismatch(path, tp, value)


def _coerce_union(tp: Any, args: tuple, value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return _coerce(options[0], value, path)
    for option in options:
        try:
            return _coerce(option, value, path)
        except ConfigError:
            continue
    raise _mismatch(path, tp, value)


def _coerce_sequence(origin: type, args: tuple, value: Any, path: str, tp: Any) -> Any:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _mismatch(path, tp, value, "; write a YAML list like [1, 2]")
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _mismatch(path, tp, value, f"; needs exactly {len(args)} items")
        items = [_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    elif args:
        items = [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    else:
        items = list(value)
    return tuple(items) if origin is tuple else items


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it converted (tuples, floats, sections)."""
    if tp is Any or tp is object:
        return value
    if tp is None or tp is type(None):
        if value is None:
            return None
        raise _mismatch(path, type(None), value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        return _coerce_union(tp, args, value, path)
    if origin is Literal:
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return value
        choices = ", ".join(repr(c) for c in args)
        raise ConfigError(f"{_where(path)}: {_got(value)} is not one of the choices {choices}")
    if origin in (list, tuple) or tp in (list, tuple):
        return _coerce_sequence(origin or tp, args, value, path, tp)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(path, tp, value, "; write a YAML mapping like {key: value}")
        key_tp, val_tp = args or (Any, Any)
        return {_coerce(key_tp, k, f"{path}.{k}"): _coerce(val_tp, v, f"{path}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, value, path)
    if isinstance(tp, type) and origin is None:
        return _coerce_scalar(tp, value, path)
    raise ConfigError(f"{_where(path)}: unsupported annotation {_type_name(tp)} in the schema; "
                      "use int, float, bool, str, Optional, Literal, list, tuple, dict or a dataclass")


def from_dict(schema: type[T], data: Mapping, path: str = "") -> T:
    """Build dataclass ``schema`` from a nested mapping, checking every key and value.

    ``path`` is the dotted location of ``data`` inside the whole config (used in messages).
    Raises ConfigError for unknown keys, missing required keys and values of the wrong type.
    """
    if not (dataclasses.is_dataclass(schema) and isinstance(schema, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {schema!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_where(path)}: expected a mapping of keys for section "
                          f"{schema.__name__}, got {_got(data)}")
    fields = _init_fields(schema)
    known = [f.name for f in fields]
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in known:
            section = f"of {path}" if path else "at the top level"
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{prefix}{key}' (known keys {section}: "
                              f"{', '.join(known)}){hint}")
    hints = typing.get_type_hints(schema)
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], prefix + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{prefix}{f.name}' "
                              f"({_type_name(hints[f.name])}): set it in the YAML file "
                              f"or override it with {prefix}{f.name}=<value>")
    try:
        return schema(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # validation in __post_init__
        raise ConfigError(f"{_where(path)}: invalid {schema.__name__}: {e}") from e


def apply_override(data: dict, override: str) -> None:
    """Apply one ``key.path=value`` override to ``data`` in place.

    The value is parsed with ``yaml.safe_load`` (so ``3``, ``1e-4``, ``true``, ``null``,
    ``[1, 2]`` and ``foo`` all work); missing intermediate sections are created.
    """
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p.strip() for p in parts):
        raise ConfigError(f"malformed override {override!r}: expected the form key.path=value, "
                          "e.g. trainer.lr=1e-4")
    parts = [p.strip() for p in parts]
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({e}); "
                          "quote it, e.g. key.path='text'") from e
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{'.'.join(parts[:i + 1])}' is "
                              f"{_got(child)}, not a section, so it has no key '{parts[i + 1]}'")
        node = child
    node[parts[-1]] = value


def load_config(schema: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Read YAML file ``path`` (optional), apply ``overrides`` in order and build ``schema``."""
    data: Any = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: '{file}'; check the path "
                              "(or pass no path to start from the schema defaults)")
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{file}' is not valid YAML: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{file}': the top level must be a mapping of "
                              f"key: value lines, got {type(data).__name__}")
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key.path=value' strings, not one string")
    for override in overrides:
        apply_override(data, override)
    return from_dict(schema, data)


def to_dict(config: Any) -> Any:
    """Turn a config dataclass into plain dicts/lists/scalars (tuples become lists).

    Fields declared with ``init=False`` are left out so the result loads back with ``from_dict``.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in _init_fields(type(config))}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def dump_yaml(config: Any) -> str:
    """Render a config as YAML (field order kept), e.g. to log the resolved config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)
