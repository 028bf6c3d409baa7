"""Tokenizers: HF ``tokenizer.json`` directories (GGUF vocabularies are rebuilt into
this class by ``gguf_io.tokenizer_from_gguf``).

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` and adds what generation needs:
BOS handling, EOS ids, the chat template, and a streaming decoder.
"""

import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.io import chat_template as chat_template_lib

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"



def _token_id(backend, token: Any) -> int | None:
  """Id of a token given as HF writes it: a string or ``{"content": ...}``."""
  if isinstance(token, Mapping):
    token = token.get("content")
  if not isinstance(token, str):
    return None
  return backend.token_to_id(token)


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, (list, tuple)):
    return [int(v) for v in value]
  return [int(value)]


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
  return tuple(dict.fromkeys(int(i) for i in ids))


class StreamDecoder:
  """Turns token ids, fed a few at a time, into newly completed text.

  A byte-level token can end in the middle of a multi-byte UTF-8 character;
  such text is held back until the character completes. Decoding always
  restarts from the last emitted token so that decoders that treat the first
  token specially (leading-space rules) give the same text as a full decode.
  """

  def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip_special = skip_special_tokens
    self._ids: list[int] = []
    self._prefix_offset = 0  # Start of the decode window (already emitted).
    self._read_offset = 0  # Ids up to here have been emitted as text.

  def feed(self, ids: int | Iterable[int]) -> str:
    """Adds ids; returns the text they complete ("" if none yet)."""
    self._ids.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
    decode = lambda a, b: self._tokenizer.decode(
        self._ids[a:b], skip_special_tokens=self._skip_special)
    prefix_text = decode(self._prefix_offset, self._read_offset)
    text = decode(self._prefix_offset, len(self._ids))
    if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
      return ""
    self._prefix_offset = self._read_offset
    self._read_offset = len(self._ids)
    return text[len(prefix_text):]

  def flush(self) -> str:
    """Returns held-back text (incomplete characters decode as U+FFFD)."""
    prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                         skip_special_tokens=self._skip_special)
    text = self._tokenizer.decode(self._ids[self._prefix_offset:],
                                  skip_special_tokens=self._skip_special)
    self._prefix_offset = self._read_offset = len(self._ids)
    return text[len(prefix_text):]


class Tokenizer:
  """Text <-> token ids for one model, with its chat template and EOS ids."""

  def __init__(self, backend, *, chat_template: str | None = None,
               bos_token_id: int | None = None,
               eos_token_ids: Sequence[int] = (), add_bos: bool = False):
    """Wraps a ``tokenizers.Tokenizer``.

    Args:
      backend: the ``tokenizers.Tokenizer``.
      chat_template: jinja2 chat template source, or None.
      bos_token_id: id of the BOS token, or None.
      eos_token_ids: ids that end generation.
      add_bos: whether ``encode`` prepends BOS (the model expects it).
    """
    self._backend = backend
    self.chat_template = chat_template
    self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
    self.eos_token_ids: tuple[int, ...] = _unique(eos_token_ids)
    self.add_bos = bool(add_bos) and self.bos_token_id is not None

  # ---------------------------------------------------------------- basics

  @property
  def backend(self):
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._backend

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included."""
    return self._backend.get_vocab_size(with_added_tokens=True)

  @property
  def bos_token(self) -> str | None:
    return None if self.bos_token_id is None else self._backend.id_to_token(
        self.bos_token_id)

  @property
  def eos_token(self) -> str | None:
    if not self.eos_token_ids:
      return None
    return self._backend.id_to_token(self.eos_token_ids[0])

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._backend.id_to_token(int(token_id))

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; BOS first only if the model wants it.

    Special-token strings in the text (``<|im_start|>``) become their ids.
    """
    ids = self._backend.encode(text, add_special_tokens=False).ids
    return [self.bos_token_id] + ids if self.add_bos else ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    return self._backend.decode([int(i) for i in ids],
                                skip_special_tokens=skip_special_tokens)

  def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
    """A fresh incremental decoder (see ``StreamDecoder``)."""
    return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

  # ----------------------------------------------------------------- chat

  def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                          **extra: Any) -> str:
    """Renders messages (or one user string) with the model's chat template."""
    if not self.chat_template:
      raise ConfigError("this tokenizer has no chat template; pass token ids or "
                        "plain text without chat formatting (chat=False)")
    return chat_template_lib.render_chat_template(
        self.chat_template, messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token, eos_token=self.eos_token, **extra)

  def encode_chat(self, messages, add_generation_prompt: bool = True,
                  **extra: Any) -> list[int]:
    """Token ids of the chat-templated prompt.

    The template writes BOS itself where the model wants it, so no BOS is added
    here (as HF's ``apply_chat_template(tokenize=True)``).
    """
    text = self.apply_chat_template(messages, add_generation_prompt, **extra)
    return self._backend.encode(text, add_special_tokens=False).ids

  # ---------------------------------------------------------- directories

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``, chat template,
    ``generation_config.json``) from a HF model directory."""
    from tokenizers import Tokenizer as Backend

    directory = pathlib.Path(path).expanduser()
    tokenizer_path = directory / TOKENIZER_FILE
    if not tokenizer_path.is_file():
      raise CheckpointError(f"tokenizer not found: {tokenizer_path} (the model "
                            "directory needs a HF tokenizer.json)")
    try:
      backend = Backend.from_file(str(tokenizer_path))
    except Exception as e:
      raise CheckpointError(f"cannot read tokenizer {tokenizer_path}: {e}") from e

    def optional_json(name: str) -> dict[str, Any]:
      file = directory / name
      if not file.is_file():
        return {}
      try:
        value = json.loads(file.read_text(encoding="utf-8"))
      except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
      if not isinstance(value, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
      return value

    tok_config = optional_json(TOKENIZER_CONFIG_FILE)
    gen_config = optional_json(GENERATION_CONFIG_FILE)
    model_config = optional_json("config.json")

    template = tok_config.get("chat_template")
    if isinstance(template, list):  # Named templates: [{"name", "template"}].
      named = {t.get("name"): t.get("template") for t in template}
      template = named.get("default") or next(iter(named.values()), None)
    template_file = directory / CHAT_TEMPLATE_FILE
    if not template and template_file.is_file():
      template = template_file.read_text(encoding="utf-8")

    bos_id = _token_id(backend, tok_config.get("bos_token"))
    if bos_id is None:
      bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
    eos_ids = [_token_id(backend, tok_config.get("eos_token"))]
    eos_ids += _as_id_list(gen_config.get("eos_token_id"))
    eos_ids = [i for i in eos_ids if i is not None]
    if not eos_ids:
      eos_ids = _as_id_list(model_config.get("eos_token_id"))

    add_bos = tok_config.get("add_bos_token")
    if add_bos is None and bos_id is not None:
      # No explicit flag: the tokenizer.json post-processor says (Llama 3 adds
      # BOS there, GPT-2 style vocabularies do not).
      probe = backend.encode("a", add_special_tokens=True).ids
      add_bos = bool(probe) and probe[0] == bos_id and (
          probe[1:] == backend.encode("a", add_special_tokens=False).ids)
    return cls(backend, chat_template=template or None, bos_token_id=bos_id,
               eos_token_ids=eos_ids, add_bos=bool(add_bos))

  def save(self, path: str | os.PathLike) -> pathlib.Path:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``generation_config.json`` (EOS / BOS ids) so ``from_dir`` restores this."""
    directory = pathlib.Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    self._backend.save(str(directory / TOKENIZER_FILE))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": self.add_bos,
        "bos_token": self.bos_token,
        "eos_token": self.eos_token,
        "clean_up_tokenization_spaces": False,
    }
    if self.chat_template:
      tok_config["chat_template"] = self.chat_template
    with open(directory / TOKENIZER_CONFIG_FILE, "w", encoding="utf-8") as f:
      json.dump(tok_config, f, indent=2, ensure_ascii=False)
      f.write("\n")
    gen_config = {"bos_token_id": self.bos_token_id,
                  "eos_token_id": list(self.eos_token_ids)}
    with open(directory / GENERATION_CONFIG_FILE, "w", encoding="utf-8") as f:
      json.dump(gen_config, f, indent=2)
      f.write("\n")
    return directory

