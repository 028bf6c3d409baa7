"""Chat templates: jinja2 rendering with the same environment HF tokenizers use.

HF renders ``tokenizer_config.json``'s ``chat_template`` in an immutable jinja2
sandbox with ``trim_blocks`` / ``lstrip_blocks``, the loop-controls extension, a
``raise_exception`` global, a ``tojson`` filter that keeps non-ASCII text, and
``strftime_now``; templates written for HF rely on exactly these.
"""

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

from dart_jax.errors import ConfigError, InputError

Message = Mapping[str, Any]


class _TemplateRaised(Exception):
  """Carries a template's own ``raise_exception(...)`` message out of jinja2."""


def _raise_exception(message: str):
  raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
  return datetime.datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  """Compiles a template once per distinct source string."""
  import jinja2
  from jinja2 import ext, sandbox

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ConfigError(f"the chat template is not valid jinja2 (line {e.lineno}): "
                      f"{e.message}") from e


def as_messages(messages: str | Sequence[Message]) -> list[dict[str, Any]]:
  """Normalises a prompt: a plain string is one user message."""
  if isinstance(messages, str):
    return [{"role": "user", "content": messages}]
  if isinstance(messages, Mapping) or not isinstance(messages, Sequence):
    raise InputError("messages must be a string or a list of {'role', 'content'} "
                     f"dicts, got {type(messages).__name__}")
  if not messages:
    raise InputError("messages is empty: give at least one message")
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or "role" not in message:
      raise InputError(f"message {i} must be a dict with a 'role' (and usually "
                       f"'content'), got {message!r:.80}")
    out.append(dict(message))
  return out


def render_chat_template(template: str, messages: str | Sequence[Message], *,
                         add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None,
                         **extra: Any) -> str:
  """Renders ``messages`` with a HF-style chat template.

  Args:
    template: jinja2 source (``tokenizer_config.json``'s ``chat_template``).
    messages: list of ``{"role": ..., "content": ...}`` or a plain user string.
    add_generation_prompt: append the header that starts the assistant's turn.
    bos_token, eos_token: token strings the template may reference.
    **extra: further template variables (``tools``, ``documents``, ...).

  Returns:
    The prompt text, special-token strings included.
  """
  import jinja2

  compiled = _compile(template)
  try:
    return compiled.render(messages=as_messages(messages),
                           add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token or "", eos_token=eos_token or "",
                           **extra)
  except _TemplateRaised as e:
    raise InputError(f"the chat template rejected the messages: {e}") from e
  except jinja2.TemplateError as e:
    raise ConfigError(f"the chat template failed to render: {e}") from e
