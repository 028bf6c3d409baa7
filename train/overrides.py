"""Reading a configuration: a preset or JSON file, then ``key=value`` overrides.

Overrides use dotted keys (``optim.learning_rate=1e-3 steps=200
data.train=a.jsonl,b.jsonl``); a JSON file's nested keys mirror the dataclasses
and may name a preset to start from with ``"base": "tiny"``. Unknown keys are
errors, with the closest valid key suggested; values are parsed by the field's
type.
"""

import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any, Mapping, Sequence

from dart_jax.errors import ConfigError
from train.configs import TrainConfig
from train.presets import PRESETS


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _suggest(name: str, options: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, list(options), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_value(text: str, kind: Any, key: str) -> Any:
  """Parses an override string into ``kind`` (int, float, bool, str, tuples, Optional)."""
  origin = typing.get_origin(kind)
  args = typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    if text.lower() in ("none", "null", ""):
      if type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    return _parse_value(text, inner[0], key)
  if origin is tuple:
    return tuple(_parse_value(part, args[0], key) for part in text.split(",") if part)
  try:
    if kind is bool:
      lowered = text.lower()
      if lowered in ("true", "1", "yes", "on"):
        return True
      if lowered in ("false", "0", "no", "off"):
        return False
      raise ValueError(text)
    if kind is int:
      return int(text)
    if kind is float:
      return float(text)
    if kind is str:
      return text
  except ValueError:
    raise ConfigError(f"bad value {text!r} for {key}: expected {kind.__name__}") from None
  raise ConfigError(f"cannot parse {key} of type {kind}")


def _coerce(value: Any, kind: Any, key: str) -> Any:
  """Checks / converts a JSON value to a field type."""
  if isinstance(value, str) and kind is not str and not (
      typing.get_origin(kind) in (typing.Union, types.UnionType) and str in typing.get_args(kind)):
    return _parse_value(value, kind, key)
  origin = typing.get_origin(kind)
  if origin is tuple:
    if isinstance(value, str):
      return (value,)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key} must be a list, got {value!r}")
    return tuple(value)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise ConfigError(f"{key} must be an integer, got {value!r}")
  if kind is bool and not isinstance(value, bool):
    raise ConfigError(f"{key} must be true or false, got {value!r}")
  return value


def _check_known(name: str, key: str, types_: Mapping[str, Any]) -> None:
  """Raises ConfigError for a config key that does not exist (with a suggestion)."""
  if name not in types_:
    raise ConfigError(f"unknown config key {key!r}{_suggest(name, list(types_))}; "
                      f"valid keys here: {', '.join(sorted(types_))}")


def _replace_nested(obj: Any, updates: Mapping[str, Any], prefix: str = "") -> Any:
  """``dataclasses.replace`` for nested sections; values may be dicts for sections."""
  types_ = _field_types(type(obj))
  changes = {}
  for name, value in updates.items():
    key = prefix + name
    _check_known(name, key, types_)
    kind = types_[name]
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
      if not isinstance(value, Mapping):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
      changes[name] = _replace_nested(current, value, key + ".")
    else:
      changes[name] = _coerce(value, kind, key)
  return dataclasses.replace(obj, **changes)


def parse_overrides(overrides: Sequence[str]) -> dict:
  """``["a.b=1", "c=x"]`` -> ``{"a": {"b": "1"}, "c": "x"}`` (values still strings)."""
  nested: dict = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not key=value (e.g. optim.learning_rate=1e-3)")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = nested
    for part in parts[:-1]:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {item!r} conflicts with an earlier one")
    node[parts[-1]] = value
  return nested


def _resolve_strings(tree: dict, config: TrainConfig) -> dict:
  """Parses string override values with the field types of ``config``."""
  def walk(obj, updates, prefix):
    types_ = _field_types(type(obj))
    out = {}
    for name, value in updates.items():
      key = prefix + name
      _check_known(name, key, types_)
      current = getattr(obj, name)
      if isinstance(value, dict):
        if not dataclasses.is_dataclass(current):
          raise ConfigError(f"{key} is not a section")
        out[name] = walk(current, value, key + ".")
      elif dataclasses.is_dataclass(current):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
      else:
        out[name] = _parse_value(value, types_[name], key)
    return out
  return walk(config, tree, "")


def load_config(name_or_file: str, overrides: Sequence[str] = ()) -> TrainConfig:
  """A preset or JSON file, with ``key=value`` overrides applied.

  Raises ConfigError for unknown presets, unreadable files, unknown keys and
  values of the wrong type.
  """
  if name_or_file in PRESETS:
    config = PRESETS[name_or_file]
  elif os.path.isfile(name_or_file):
    try:
      with open(name_or_file, encoding="utf-8") as f:
        raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"cannot read config file {name_or_file!r}: {e}") from e
    if not isinstance(raw, dict):
      raise ConfigError(f"config file {name_or_file!r} must hold a JSON object")
    base = raw.pop("base", None)
    if base is not None and base not in PRESETS:
      raise ConfigError(f"config file {name_or_file!r}: unknown base preset {base!r}; "
                        f"presets: {', '.join(PRESETS)}")
    config = _replace_nested(PRESETS[base] if base else TrainConfig(), raw)
  else:
    raise ConfigError(f"--config {name_or_file!r} is neither a preset "
                      f"({', '.join(PRESETS)}) nor an existing JSON file"
                      f"{_suggest(name_or_file, list(PRESETS))}")
  if overrides:
    config = _replace_nested(config, _resolve_strings(parse_overrides(overrides), config))
  return config
