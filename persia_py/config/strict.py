"""Keyword-only dataclasses built from YAML, every key checked: an unknown or misspelled
key, a wrong type or a missing required key is a :class:`ConfigError` naming the key path,
what was expected and, for a misspelling, the closest valid key."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Literal

import yaml

__all__ = ["ConfigError", "build", "load_file"]


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key path."""


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is dict:
        return "a mapping"
    if origin is list:
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; build nested dataclasses."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            try:
                return _convert(arg, value, path)
            except ConfigError:
                continue
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, val_tp = typing.get_args(tp)
            return {
                _convert(key_tp, k, f"{path}.{k}"): _convert(val_tp, v, f"{path}.{k}")
                for k, v in value.items()
            }
    elif origin is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp)
            return [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")


def build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<top level>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    # init=False fields are derived in __post_init__, never config keys.
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{prefix}{key}: unknown key (valid keys here: {sorted(fields)}){hint}"
            )
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}")
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and (
            f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(f"{prefix}{name}: required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None


def load_file(cls: type, path: str | os.PathLike) -> Any:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return build(cls, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
