"""Typed configs on OmegaConf structured configs: YAML files and ``key.path=value`` overrides
fill nested dataclasses, and every mistake is a ``ConfigError`` naming the dotted key path.

A schema is a (frozen or plain) ``@dataclass`` with type hints; sections are nested dataclasses.
OmegaConf (>= 2.4) checks ``int``, ``float``, ``bool``, ``str``, ``Optional``, ``Literal``,
``list``, ``tuple`` and ``dict`` annotations; this module layers files, schema defaults and
overrides, turns OmegaConf's errors into messages that name the path, the expected type, the
value and the fix, and builds the dataclasses section by section so that a ``__post_init__``
check names its section too. ``${other.key}`` interpolations resolve against the whole config.
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
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from mcore_rl.errors import McoreRLError

__all__ = ["ConfigError", "load_config", "from_dict", "to_dict", "dump_yaml"]

T = TypeVar("T")


class ConfigError(McoreRLError, ValueError):
    """A config file, override or value does not fit the schema; the message says how to fix it."""


def _where(path: str) -> str:
    return path or "<top level>"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "")


def _path_parts(full_key: str) -> list[str]:
    """'a.b[1].c' -> ['a', 'b', '1', 'c']."""
    return re.findall(r"[^.\[\]]+", full_key)


def _expected_type(schema: type, full_key: str) -> Any:
    """The annotation that governs ``full_key`` inside ``schema`` (None when not found)."""
    tp: Any = schema
    for part in _path_parts(full_key):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is Union or origin is types.UnionType:
            tp = next((a for a in args if a is not type(None)), None)
            origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        elif origin in (list, tuple) and args:
            tp = args[0] if origin is list or args[-1] is Ellipsis else args[min(int(part), len(args) - 1)]
        elif origin is dict and args:
            tp = args[1]
        else:
            return None
        if tp is None:
            return None
    return tp


def _lookup(data: Any, full_key: str) -> tuple[bool, Any]:
    """(found, value) of ``full_key`` inside plain nested dicts/lists ``data``."""
    for part in _path_parts(full_key):
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return False, None
    return True, data


def _unknown_key(error: oc_errors.ConfigKeyError, schema: type) -> ConfigError:
    full_key = str(error.full_key)
    section, _, key = full_key.rpartition(".")
    owner = error.object_type if dataclasses.is_dataclass(error.object_type) else None
    if owner is None:
        owner = _expected_type(schema, section) if section else schema
    known = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
    where = f"of {section}" if section else "at the top level"
    close = difflib.get_close_matches(key, known, n=1)
    prefix = f"{section}." if section else ""
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{full_key}' (known keys {where}: {', '.join(known)}){hint}")


def _wrap(error: Exception, schema: type, source: Any, origin: str) -> ConfigError:
    """An OmegaConf error raised while merging ``source`` (plain data) as a ConfigError."""
    if isinstance(error, oc_errors.ConfigKeyError) and error.full_key:
        return _unknown_key(error, schema)
    full_key = str(getattr(error, "full_key", "") or "")
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    expected = _expected_type(schema, full_key) if full_key else None
    found, value = _lookup(source, full_key)
    if not full_key or expected is None or not found:
        return ConfigError(f"{_where(full_key)}: {detail} ({origin})")
    shown = f"{value!r} ({type(value).__name__})"
    hint = ""
    if dataclasses.is_dataclass(expected):
        hint = f"; write a mapping of keys for section {expected.__name__}"
    elif typing.get_origin(expected) in (list, tuple):
        args = typing.get_args(expected)
        fixed = typing.get_origin(expected) is tuple and args and args[-1] is not Ellipsis
        hint = f"; write a YAML list of {len(args)} items" if fixed else "; write a YAML list like [1, 2]"
        if isinstance(value, Mapping):  # e.g. the override a.list.0=x: lists are replaced whole
            hint += f" (an override replaces the whole list: {full_key}=[...])"
    elif typing.get_origin(expected) is dict:
        hint = "; write a mapping like {key: value}"
    return ConfigError(f"{full_key}: expected {_type_name(expected)}, got {shown}{hint} "
                       f"({origin}: {detail})")


def _leaves(data: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf of nested mappings; a non-mapping is a leaf."""
    if not isinstance(data, Mapping) or not data:
        return [(path, data)]
    return [leaf for k, v in data.items() for leaf in _leaves(v, f"{path}.{k}" if path else str(k))]


def _nested(path: str, value: Any) -> dict:
    for part in reversed(path.split(".")[1:]):
        value = {part: value}
    return {path.split(".")[0]: value}


def _container_mismatch(schema: type, data: Mapping, path: str) -> str:
    """The first prefix of ``path`` where ``data`` holds a list for a mapping or the reverse
    (OmegaConf's TypeError for that names no key); ``path`` itself when none is found."""
    parts = path.split(".")
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        origin = typing.get_origin(_expected_type(schema, prefix))
        _, value = _lookup(data, prefix)
        if (origin in (list, tuple) and isinstance(value, Mapping)) or \
                (origin is dict and isinstance(value, (list, tuple))):
            return prefix
    return path


_MERGE_ERRORS = (oc_errors.OmegaConfBaseException, ValueError, TypeError)  # TypeError: list vs mapping


def _merge(base: DictConfig, data: Mapping, schema: type, origin: str) -> DictConfig:
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, data))
    except _MERGE_ERRORS as e:
        error: Exception = e
    if not getattr(error, "full_key", None):  # some merge errors lose the key: find it leaf by leaf
        for path, value in _leaves(data):
            try:
                OmegaConf.merge(base, _nested(path, value))
            except _MERGE_ERRORS as leaf_error:
                key = getattr(leaf_error, "full_key", None) or path
                if isinstance(leaf_error, TypeError):
                    key = _container_mismatch(schema, data, path)
                leaf_error.full_key = key  # type: ignore[attr-defined]
                error = leaf_error
                break
    raise _wrap(error, schema, data, origin)


def _leaf(node: DictConfig, name: str, path: str) -> Any:
    try:
        value = node[name]
    except oc_errors.InterpolationResolutionError as e:
        raise ConfigError(f"{path}: cannot resolve {OmegaConf.to_container(node)[name]!r}: "
                          f"{str(e).splitlines()[0]}") from None
    except (oc_errors.OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    if OmegaConf.is_config(value):
        return OmegaConf.to_object(value)
    return value


def _shape_error(value: Any, tp: Any, path: str) -> tuple[str, Any, Any] | None:
    """(path, expected type, value) of the first container where a scalar is expected, or of
    the wrong container kind, inside ``value`` (OmegaConf checks only the outer container)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        return _shape_error(value, others[0], path) if len(others) == 1 else None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return path, tp, value
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        for i, item in enumerate(value):
            item_tp = (args[min(i, len(args) - 1)] if fixed else args[0]) if args else Any
            found = _shape_error(item, item_tp, f"{path}[{i}]")
            if found:
                return found
    elif origin is dict:
        if not isinstance(value, Mapping):
            return path, tp, value
        for k, item in value.items():
            found = _shape_error(item, args[1] if args else Any, f"{path}.{k}")
            if found:
                return found
    elif tp in (int, float, bool, str) and isinstance(value, (list, tuple, Mapping)):
        return path, tp, value
    return None


def _build(schema: type[T], node: DictConfig, path: str) -> T:
    """Instantiates ``schema`` from a merged config, innermost sections first."""
    hints = typing.get_type_hints(schema)
    prefix = f"{path}." if path else ""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        where = prefix + f.name
        if OmegaConf.is_missing(node, f.name):
            raise ConfigError(f"missing required key '{where}' ({_type_name(hints[f.name])}): set it "
                              f"in the YAML file or override it with {where}=<value>")
        child = node._get_node(f.name)
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(child, DictConfig) and not child._is_none():
            kwargs[f.name] = _build(hints[f.name], child, where)
        else:
            kwargs[f.name] = _leaf(node, f.name, where)
            wrong = _shape_error(kwargs[f.name], hints[f.name], where)
            if wrong:
                at, expected, value = wrong
                raise ConfigError(f"{at}: expected {_type_name(expected)}, got {value!r} "
                                  f"({type(value).__name__}); set {at} to a {_type_name(expected)}")
    try:
        return schema(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # validation in __post_init__
        raise ConfigError(f"{_where(path)}: invalid {schema.__name__}: {e}") from e


def _parse_override(override: str) -> dict:
    """``key.path=value`` -> nested dict; the value is read as YAML (``1e-4`` is a float)."""
    key, sep, raw = override.partition("=")
    parts = [p.strip() for p in key.split(".")]
    if not sep or not key.strip() or any(not p for p in parts):
        raise ConfigError(f"malformed override {override!r}: expected the form key.path=value, "
                          "e.g. trainer.lr=1e-4")
    try:
        return typing.cast(dict, OmegaConf.to_container(
            OmegaConf.from_dotlist([f"{'.'.join(parts)}={raw.strip()}"]), resolve=False))
    except (yaml.YAMLError, oc_errors.OmegaConfBaseException) as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML "
                          f"({str(e).splitlines()[0]}); quote it, e.g. key.path='text'") from None


def _read_file(path: str | os.PathLike) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: '{file}'; check the path "
                          "(or pass no path to start from the schema defaults)")
    try:
        data = OmegaConf.create(file.read_text() or "{}")
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{file}' is not valid YAML: {e}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"config file '{file}': the top level must be a mapping of "
                          f"key: value lines, got {type(OmegaConf.to_object(data)).__name__}")
    return OmegaConf.to_container(data, resolve=False)


def from_dict(schema: type[T], *layers: Mapping, origins: Sequence[str] = ()) -> T:
    """Builds dataclass ``schema`` from its defaults overlaid by ``layers`` (nested mappings).

    Raises ConfigError for unknown keys, missing required keys, values of the wrong type and
    failed ``__post_init__`` checks, naming the dotted path (and the layer's ``origins``).
    """
    if not (dataclasses.is_dataclass(schema) and isinstance(schema, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {schema!r}")
    merged = OmegaConf.structured(schema)
    for i, layer in enumerate(layers):
        origin = origins[i] if i < len(origins) else f"layer {i}"
        if not isinstance(layer, Mapping):
            raise ConfigError(f"{origin}: expected a mapping of keys, got {layer!r}")
        merged = _merge(merged, layer, schema, origin)
    return _build(schema, merged, "")


def load_config(schema: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] = (), defaults: Mapping | None = None) -> T:
    """Builds ``schema`` from: its dataclass defaults, ``defaults`` (e.g. ``${steps}``
    interpolations a schema wants as its defaults), YAML file ``path``, then ``overrides``
    (``key.path=value`` strings, in order)."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key.path=value' strings, not one string")
    layers: list[Mapping] = [dict(defaults or {})]
    origins = ["schema defaults"]
    if path is not None:
        layers.append(_read_file(path))
        origins.append(f"file '{path}'")
    for override in overrides:
        layers.append(_parse_override(override))
        origins.append(f"override '{override}'")
    return from_dict(schema, *layers, origins=origins)


def to_dict(config: Any) -> Any:
    """A config dataclass as plain dicts/lists/scalars (tuples become lists)."""
    return _lists(OmegaConf.to_container(OmegaConf.structured(config), resolve=True))


def _lists(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _lists(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_lists(v) for v in data]
    return data


def dump_yaml(config: Any) -> str:
    """Renders a config as YAML (field order kept), e.g. to log the resolved config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)
