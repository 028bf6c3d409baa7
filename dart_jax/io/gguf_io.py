"""GGUF (llama.cpp) checkpoints: Llama architecture, dequantised to float32.

GGUF differs from HF checkpoints in three ways this module undoes:
  * names: ``blk.N.attn_q.weight`` instead of ``model.layers.N.self_attn.q_proj.weight``;
  * q / k rows: llama.cpp's converter interleaves the two rotary halves of every
    head; HF keeps them as contiguous halves;
  * weights are block-quantised; ``gguf.quants.dequantize`` expands them.
GGUF lists dims fastest-first (``[in, out]``); the reader's numpy arrays are
already row-major ``[out, in]`` (the HF layout), which is checked per tensor.
"""

import functools
import logging
import os
import pathlib
import re
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.io.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Llama-3 pre-tokenizer split (llama.cpp "llama-bpe"): letters, 1-3 digit groups,
# punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` values whose vocab was trained with every digit its own
# pre-token, followed by the GPT-2 byte-level split (SmolLM, StarCoder).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact"})
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"})
# Of those, the ones llama.cpp treats as Llama 3 proper: whole-word vocabulary
# lookups before merges ("ignore merges") and BOS added unless the file says no.
_LLAMA3_PROPER_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})

# Types this loader dequantises (all exactly as ggml does, via the gguf package).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


# ----------------------------------------------------------------- reading


def reader_path(reader) -> str:
  """The file a GGUFReader reads (for messages)."""
  path = getattr(reader, "source_path", None) or getattr(reader.data, "filename", None)
  return str(path or "<gguf>")


@functools.lru_cache(maxsize=None)
def _fast_reader_class():
  """``gguf.GGUFReader`` over a plain ndarray view of its memory map.

  The reader slices its buffer once per metadata item (about 250k times for a
  49k-token vocabulary), and every ``np.memmap`` slice runs Python-level
  bookkeeping; over a plain ndarray view of the same mapping opening the
  embedded SmolLM2 file is about 2.5x faster. Only the public ``data``
  attribute the reader assigns in its constructor is intercepted.
  """
  import gguf

  class FastGGUFReader(gguf.GGUFReader):
    source_path: str | None = None

    @property
    def data(self):
      return self._buffer

    @data.setter
    def data(self, value):
      if isinstance(value, np.memmap):
        self.source_path = value.filename
        value = value.view(np.ndarray)  # Still backed by (and keeps) the mmap.
      self._buffer = value

  return FastGGUFReader


def open_gguf(reader_or_path):
  """A ``gguf.GGUFReader`` for a path (or the reader itself, passed through)."""
  import gguf

  if isinstance(reader_or_path, gguf.GGUFReader):
    return reader_or_path
  path = pathlib.Path(reader_or_path).expanduser()
  if not path.exists():
    raise CheckpointError(f"GGUF file does not exist: {path}")
  if not path.is_file():
    raise CheckpointError(f"GGUF path is not a file: {path}")
  try:
    return _fast_reader_class()(str(path))
  except Exception as e:  # Bad magic, truncated header, bad offsets, ...
    raise CheckpointError(f"cannot read GGUF file {path}: {e} (it is not a GGUF "
                          "file, or it is corrupt or truncated)") from e


class GGUFFields:
  """Decoded GGUF metadata values by key (strings, numbers, lists)."""

  def __init__(self, reader):
    import gguf

    self._reader = reader
    self._string = gguf.GGUFValueType.STRING
    self._array = gguf.GGUFValueType.ARRAY
    self._cache: dict[str, Any] = {}

  def _decode(self, field) -> Any:
    types = list(field.types)
    if not types:
      return None
    is_string = types[-1] == self._string

    def item(index: int) -> Any:
      part = field.parts[index]
      return part.tobytes().decode("utf-8") if is_string else part.tolist()[0]

    if types[0] == self._array:
      return [item(i) for i in field.data]
    return item(field.data[0])

  def __contains__(self, key: str) -> bool:
    return key in self._reader.fields

  def get(self, key: str, default: Any = None) -> Any:
    if key not in self._reader.fields:
      return default
    if key not in self._cache:
      try:
        self._cache[key] = self._decode(self._reader.fields[key])
      except Exception as e:
        raise CheckpointError(f"{reader_path(self._reader)}: cannot decode GGUF "
                              f"field {key!r}: {e}") from e
    return self._cache[key]

  def require(self, key: str) -> Any:
    value = self.get(key)
    if value is None:
      raise CheckpointError(f"{reader_path(self._reader)}: GGUF metadata lacks "
                            f"required key {key!r}")
    return value


def gguf_eos_token_ids(fields: GGUFFields) -> list[int]:
  """Ids that end a turn: EOS, plus end-of-turn / end-of-message if given."""
  ids = [fields.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
  return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _float32_repr(value: float) -> float:
  """The shortest decimal of a float32 (1e-05, not 9.999999747378752e-06)."""
  return float(str(np.float32(value)))


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row interleave: w [out, ...] -> HF order.

  llama.cpp stores each head's rows as (pair, 2) interleaved; HF keeps the two
  rotary halves contiguous: reshape [H, out/H/2, 2, ...] -> swap -> [out, ...].
  """
  out = w.shape[0]
  if out % (2 * n_head):
    raise CheckpointError(f"cannot un-permute {out} rows over {n_head} heads")
  rest = w.shape[1:]
  return (w.reshape(n_head, out // n_head // 2, 2, *rest)
          .swapaxes(1, 2).reshape(out, *rest))


def _dequantize(tensor, where: str) -> np.ndarray:
  """One GGUF tensor as float32 [out, in] (HF layout; 1-D stays 1-D)."""
  from gguf import quants

  type_name = tensor.tensor_type.name
  if type_name not in SUPPORTED_TYPES:
    raise CheckpointError(
        f"{where}: tensor {tensor.name!r} has quantisation type {type_name}, which "
        f"is not supported (supported: {', '.join(SUPPORTED_TYPES)}); use a GGUF "
        "quantised with one of these")
  try:
    array = quants.dequantize(tensor.data, tensor.tensor_type)
  except Exception as e:
    raise CheckpointError(f"{where}: cannot dequantise tensor {tensor.name!r} "
                          f"({type_name}): {e} (the file may be truncated)") from e
  # GGUF dims are listed fastest-first; row-major numpy is their reverse.
  expected = tuple(int(d) for d in reversed(list(tensor.shape)))
  if array.shape != expected:
    raise CheckpointError(f"{where}: tensor {tensor.name!r} dequantised to shape "
                          f"{array.shape}, expected {expected} (truncated file?)")
  # Copy: detaches F32 tensors from the reader's memory map.
  return np.array(array, dtype=np.float32)


def _hf_name(name: str, where: str) -> str:
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  match = _LAYER_RE.match(name)
  if match and match.group(2) in _LAYER_NAMES:
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
  raise CheckpointError(f"{where}: unexpected tensor {name!r} for a Llama GGUF; "
                        "this loader knows only the standard Llama tensors")


def _llama3_rope_divisors(theta: float, head_dim: int, factor: float, low: float,
                          high: float, original: int) -> np.ndarray:
  """Per-frequency divisors [head_dim // 2] that Llama-3 RoPE scaling applies."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * np.pi / inv
  smooth = (original / wavelen - low) / (high - low)
  mid = 1.0 / ((1 - smooth) / factor + smooth)
  return np.where(wavelen < original / high, 1.0,
                  np.where(wavelen > original / low, factor, mid))


def _llama3_rope_scaling(hf: dict[str, Any], rope_freqs: np.ndarray,
                         original_context: int | None, where: str
                         ) -> dict[str, Any] | None:
  """Recovers Llama-3 RoPE scaling from llama.cpp's ``rope_freqs`` tensor.

  llama.cpp stores the per-frequency divisors instead of the four scaling
  numbers; the numbers are found by matching the divisors they produce.
  """
  if np.allclose(rope_freqs, 1.0):
    return None
  head_dim, theta = hf["head_dim"], hf["rope_theta"]
  if rope_freqs.shape != (head_dim // 2,):
    raise ConfigError(f"{where}: rope_freqs has shape {rope_freqs.shape}, expected "
                      f"[head_dim / 2] = [{head_dim // 2}]")
  factor = float(rope_freqs.max())
  # Llama 3.x uses 8192; other powers of two are tried for derived models.
  contexts = [original_context] if original_context else [
      8192, *(2 ** k for k in range(6, 18) if k != 13)]
  for context in contexts:
    for low in (1.0, 0.5, 2.0, 4.0):
      for high in (4.0, 2.0, 8.0, 16.0, 32.0):
        if high <= low:
          continue
        divisors = _llama3_rope_divisors(theta, head_dim, factor, low, high, context)
        if np.allclose(divisors, rope_freqs, rtol=1e-4, atol=0):
          return {"rope_type": "llama3", "factor": _float32_repr(factor),
                  "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": int(context)}
  raise ConfigError(f"{where}: the rope_freqs tensor does not match Llama-3 RoPE "
                    "scaling; this RoPE variant is not supported")


def _hf_config(fields: GGUFFields, tensors: dict[str, np.ndarray],
               rope_freqs: np.ndarray | None, where: str) -> dict[str, Any]:
  """A HF ``config.json``-style dictionary from ``llama.*`` metadata."""
  p = "llama."
  hidden = int(fields.require(p + "embedding_length"))
  heads = int(fields.require(p + "attention.head_count"))
  kv_heads = int(fields.get(p + "attention.head_count_kv") or heads)
  head_dim = fields.get(p + "attention.key_length") or fields.get(
      p + "rope.dimension_count") or hidden // heads
  rope_dim = fields.get(p + "rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != int(head_dim):
    raise ConfigError(f"{where}: partial rotary embeddings (rope dim {rope_dim} < "
                      f"head dim {head_dim}) are not supported")
  embed = tensors.get("model.embed_tokens.weight")
  if embed is None:
    raise CheckpointError(f"{where}: GGUF has no token_embd.weight tensor")
  eos_ids = gguf_eos_token_ids(fields)
  hf: dict[str, Any] = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": int(embed.shape[0]),
      "hidden_size": hidden,
      "intermediate_size": int(fields.require(p + "feed_forward_length")),
      "num_hidden_layers": int(fields.require(p + "block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": int(head_dim),
      "rms_norm_eps": _float32_repr(
          fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_theta": _float32_repr(fields.get(p + "rope.freq_base", 10000.0)),
      "max_position_embeddings": int(fields.get(p + "context_length", 4096)),
      "tie_word_embeddings": "lm_head.weight" not in tensors,
      "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
      "hidden_act": "silu",
      "torch_dtype": "float32",
      "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
  }
  scaling_type = fields.get(p + "rope.scaling.type")
  linear = fields.get(p + "rope.scale_linear")
  if scaling_type not in (None, "none") or (linear not in (None, 1.0)):
    raise ConfigError(f"{where}: RoPE scaling type {scaling_type or 'linear'!r} is "
                      "not supported (supported: none, llama3 via rope_freqs)")
  if rope_freqs is not None:
    scaling = _llama3_rope_scaling(
        hf, rope_freqs, fields.get(p + "rope.scaling.original_context_length"), where)
    if scaling is not None:
      hf["rope_scaling"] = scaling
  return hf


def _check_complete(hf: dict[str, Any], tensors: dict[str, np.ndarray], where: str):
  """Every Llama weight present, so a partial file fails here, by name."""
  needed = ["model.embed_tokens.weight", "model.norm.weight"]
  for i in range(hf["num_hidden_layers"]):
    needed += [f"model.layers.{i}.{part}.weight" for part in _LAYER_NAMES.values()]
  missing = [n for n in needed if n not in tensors]
  if missing:
    raise CheckpointError(f"{where}: {len(missing)} Llama tensor(s) missing, e.g. "
                          f"{missing[:3]}")


def read_gguf(path: str | os.PathLike):
  """Reads a Llama GGUF file.

  Args:
    path: the ``.gguf`` file.

  Returns:
    (hf_config, tensors, tokenizer): a HF-style config dictionary, float32 numpy
    tensors by HF name in HF layout (``q_proj.weight: [heads * head_dim,
    hidden]``), and the ``Tokenizer`` rebuilt from the GGUF metadata.
  """
  reader = open_gguf(path)
  where = str(pathlib.Path(path).expanduser())
  fields = GGUFFields(reader)
  arch = fields.get("general.architecture")
  if arch != "llama":
    raise ConfigError(f"{where}: GGUF architecture {arch!r} is not supported; GGUF "
                      "loading supports 'llama' only (use a HF safetensors directory "
                      "for other models)")
  heads = int(fields.require("llama.attention.head_count"))
  kv_heads = int(fields.get("llama.attention.head_count_kv") or heads)

  tensors: dict[str, np.ndarray] = {}
  rope_freqs = None
  for tensor in reader.tensors:
    array = _dequantize(tensor, where)
    if tensor.name == _ROPE_FREQS:
      rope_freqs = array
      continue
    name = _hf_name(tensor.name, where)
    if ".self_attn.q_proj." in name:
      array = _unpermute_rows(array, heads)
    elif ".self_attn.k_proj." in name:
      array = _unpermute_rows(array, kv_heads)
    tensors[name] = array

  hf = _hf_config(fields, tensors, rope_freqs, where)
  _check_complete(hf, tensors, where)
  return hf, tensors, tokenizer_from_gguf(reader)


def tokenizer_from_gguf(reader_or_path) -> Tokenizer:
  """Rebuilds the tokenizer stored in a GGUF file's metadata.

  Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``),
  which is what llama.cpp writes for SmolLM, Llama 3 and most BPE models.
  """
  reader = open_gguf(reader_or_path)
  where = reader_path(reader)
  fields = GGUFFields(reader)
  kind = fields.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ConfigError(
        f"{where}: GGUF tokenizer type {kind!r} is not supported (only byte-level "
        "BPE, 'gpt2'); convert the model to a HF directory with tokenizer.json")
  tokens = fields.require("tokenizer.ggml.tokens")
  merges = fields.get("tokenizer.ggml.merges") or []
  token_types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  if len(token_types) != len(tokens):
    raise CheckpointError(f"{where}: {len(tokens)} tokens but {len(token_types)} "
                          "token types")

  pre = fields.get("tokenizer.ggml.pre") or "default"
  ignore_merges = False
  if pre in _DIGIT_SPLIT_PRE:
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  elif pre in _LLAMA3_PRE:
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # llama.cpp and HF's Llama 3 tokenizer take a whole pre-token that is in
    # the vocabulary as is, before trying merges.
    ignore_merges = pre in _LLAMA3_PROPER_PRE
  else:
    if pre not in _GPT2_PRE:
      logger.warning("%s: unknown GGUF pre-tokenizer %r; using the GPT-2 split, "
                     "tokenization may differ slightly from the original", where, pre)
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                               ignore_merges=ignore_merges))
  backend.pre_tokenizer = pre_tokenizer
  backend.decoder = decoders.ByteLevel()
  # Control tokens (<|im_start|>, <|eot_id|>) must match whole in text and be
  # dropped by skip_special_tokens; user-defined ones match whole but decode.
  special = [AddedToken(t, special=True, normalized=False)
             for t, kind in zip(tokens, token_types) if kind == _GGUF_CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, kind in zip(tokens, token_types) if kind == _GGUF_USER_DEFINED]
  if special:
    backend.add_special_tokens(special)
  if user:
    backend.add_tokens(user)

  bos_id = fields.get("tokenizer.ggml.bos_token_id")
  return Tokenizer(backend, chat_template=fields.get("tokenizer.chat_template"),
             bos_token_id=bos_id, eos_token_ids=gguf_eos_token_ids(fields),
             add_bos=bool(fields.get("tokenizer.ggml.add_bos_token",
                                     pre in _LLAMA3_PROPER_PRE)))
