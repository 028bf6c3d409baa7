"""The DART draft head: one Llama-style layer that drafts D+1 levels in one pass.

See ``docs/algorithms.md``, "DART". Parameter names follow the reference
release (``fc.``, ``midlayer.*``, ``norm.``, ``lm_head.``, buffers ``d2t``/``t2d``)
so released heads load and heads trained here run in the reference.
"""

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax import sharding as sharding_lib
from dart_jax.errors import ConfigError
from dart_jax.models import checkpoint, layers
from dart_jax.models import precision as precision_lib
from dart_jax.models.config import RopeScaling, rope_from_hf, rope_inv_freq
from dart_jax.models.precision import Precision
from dart_jax.models.transformer import Attention, KVCache
from dart_jax.io import embedded_dart_dir, embedded_tree_config, read_safetensors_dir
from dart_jax.tree import TreeConfig


class Buffer(nnx.Variable):
  """A non-trainable array stored with the head (``d2t``, ``t2d``)."""


@dataclasses.dataclass(frozen=True)
class DartConfig:
  """Architecture of a DART head.

  draft_length: D, the number of mask slots (the head drafts D+1 levels).
  draft_vocab_size: Vd, rows of ``lm_head``; ``d2t`` maps them to target ids.
  tap_layers: target layers whose INPUTS are concatenated (low, mid, high).
  double_norm: apply ``norm`` at the end of the layer and again before
    ``lm_head`` (the reference release does; released heads need it).
  """

  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  draft_vocab_size: int
  target_hidden_size: int
  draft_length: int
  tap_layers: tuple[int, int, int]
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  double_norm: bool = True

  def __post_init__(self):
    if self.draft_length < 0:
      raise ConfigError(f"draft_length must be >= 0, got {self.draft_length}")
    if not 0 < self.draft_vocab_size <= self.vocab_size:
      raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                        f"[1, vocab_size={self.vocab_size}]")

  @property
  def num_levels(self) -> int:
    return self.draft_length + 1

  def to_hf(self) -> dict:
    """config.json in the reference format, plus our keys under ``dart_jax``."""
    hf = {
        "architectures": ["LlamaForCausalLMDart"],
        "model_type": "llama",
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": self.vocab_size,
        "draft_vocab_size": self.draft_vocab_size,
        "target_hidden_size": self.target_hidden_size,
        "draft_length": self.draft_length,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dart_jax": {"tap_layers": list(self.tap_layers), "double_norm": self.double_norm},
    }
    if self.rope_scaling is not None:
      hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
    return hf

  @classmethod
  def from_hf(cls, hf: dict, target_config) -> "DartConfig":
    """Reads a reference (or our) config.json; tap layers default to 2, L//2, L-3."""
    try:
      num_heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      theta, scaling = rope_from_hf(hf)
      ours = hf.get("dart_jax", {})
      return cls(
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_heads=num_heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
          head_dim=int(hf.get("head_dim") or hidden // num_heads),
          vocab_size=int(hf["vocab_size"]),
          draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
          target_hidden_size=int(hf.get("target_hidden_size") or hidden),
          draft_length=int(hf["draft_length"]),
          tap_layers=tuple(ours["tap_layers"] if "tap_layers" in ours
                           else target_config.dart_tap_layers),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          rope_theta=theta,
          rope_scaling=scaling,
          double_norm=bool(ours.get("double_norm", True)),
      )
    except KeyError as e:
      raise ConfigError(f"DART config.json is missing required key {e.args[0]!r}") from e


class DartLayer(nnx.Module):
  """The head's single decoder layer (``midlayer``)."""

  def __init__(self, c: DartConfig, *, rngs: nnx.Rngs, precision: Precision | Any = jnp.float32):
    h = c.hidden_size
    self.mask_rep = nnx.Param(jax.random.normal(rngs.params(), (2 * h,),
                                                precision_lib.resolve(precision).dtype))
    self.hidden_norm = layers.RMSNorm(h, c.rms_norm_eps, precision=precision)
    self.input_layernorm = layers.RMSNorm(h, c.rms_norm_eps, precision=precision)
    self.post_attention_layernorm = layers.RMSNorm(h, c.rms_norm_eps,
                                                   precision=precision)
    self.self_attn = Attention(in_features=2 * h, out_features=h, num_heads=c.num_heads,
                               num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                               rngs=rngs, precision=precision)
    self.mlp = layers.SwiGLU(h, c.intermediate_size, rngs=rngs, precision=precision)


class DartHeadModule(nnx.Module):
  """NNX parameters of a DART head and its forward pass."""

  def __init__(self, c: DartConfig, *, rngs: nnx.Rngs, precision: Precision | Any = jnp.float32):
    self.config = c
    self.precision = precision_lib.resolve(precision)
    self.fc = layers.linear(3 * c.target_hidden_size, c.hidden_size, rngs=rngs,
                            precision=precision)
    self.midlayer = DartLayer(c, rngs=rngs, precision=precision)
    self.norm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps, precision=precision)
    self.lm_head = layers.linear(c.hidden_size, c.draft_vocab_size, rngs=rngs,
                                 precision=precision)
    self.d2t = Buffer(jnp.zeros((c.draft_vocab_size,), jnp.int32))
    self.t2d = Buffer(jnp.ones((c.vocab_size,), bool))
    self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, c.rope_theta,
                                                          c.rope_scaling))

  def real_rows(self, taps: jax.Array, next_embeds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention inputs and residuals of real positions.

    taps: [..., 3*Ht] target taps at positions p; next_embeds: [..., H] embeddings
    of the tokens at p+1. Returns (attn_in [..., 2H], residual [..., H]).
    """
    g = self.fc(taps)
    layer = self.midlayer
    attn_in = jnp.concatenate([layer.input_layernorm(next_embeds.astype(g.dtype)),
                               layer.hidden_norm(g)], axis=-1)
    return attn_in, g

  def mask_rows(self) -> tuple[jax.Array, jax.Array]:
    """The mask slot's (attn_in [2H], residual [H]); mask rows are not normalised."""
    rep = self.midlayer.mask_rep[...]
    return rep, rep[: self.config.hidden_size]

  def final_hidden(self, h: jax.Array) -> jax.Array:
    """Residual after attention -> the normed hidden ``lm_head`` reads: [..., H]."""
    layer = self.midlayer
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = self.norm(h)
    if self.config.double_norm:
      h = self.norm(h)
    return h

  def logits(self, hidden: jax.Array) -> jax.Array:
    """``final_hidden`` output [..., H] -> draft logits [..., Vd] float32."""
    return self.lm_head(hidden).astype(jnp.float32)

  def finish(self, h: jax.Array) -> jax.Array:
    """Residual after attention -> draft logits. h: [..., H] -> [..., Vd] float32."""
    return self.logits(self.final_hidden(h))

  def __call__(self, taps: jax.Array, next_embeds: jax.Array, num_real: jax.Array,
               cache: KVCache, *, attend_len: int | None = None,
               attn_impl: str = "auto") -> tuple[jax.Array, KVCache]:
    """Drafts D+1 levels: ``levels`` then ``logits`` -> (logits [B, D+1, Vd], cache)."""
    hidden, cache = self.levels(taps, next_embeds, num_real, cache, attend_len=attend_len,
                                attn_impl=attn_impl)
    return self.logits(hidden), cache

  def levels(self, taps: jax.Array, next_embeds: jax.Array, num_real: jax.Array,
             cache: KVCache, *, attend_len: int | None = None,
             attn_impl: str = "auto") -> tuple[jax.Array, KVCache]:
    """The final hidden of D+1 levels after the newest real position of each sequence.

    Args:
      taps: [B, S, 3*Ht] taps at the new real positions (right-padded).
      next_embeds: [B, S, H] embeddings of the token after each of them.
      num_real: [B] how many of the S rows are real (>= 1).
      cache: one-layer draft cache holding the earlier real positions; the S+D
        rows are written at ``cache.lengths`` (lengths not advanced).
    Returns:
      (hidden [B, D+1, H] as ``lm_head`` reads it, cache). Row 0 comes from the
      last real position and predicts the token two after it; row k from mask
      slot k.
    """
    c = self.config
    batch, s, _ = taps.shape
    n = s + c.draft_length
    attn_real, res_real = self.real_rows(taps, next_embeds)
    attn_mask, res_mask = self.mask_rows()
    # Row i of sequence b is real if i < num_real[b], a mask slot for the next D
    # rows, padding after that: the mask slots follow the real rows directly.
    row = jnp.arange(n)
    is_real = (row[None, :] < num_real[:, None])[..., None]
    pad = jnp.zeros((batch, c.draft_length, attn_real.shape[-1]), attn_real.dtype)
    attn_in = jnp.where(is_real, jnp.concatenate([attn_real, pad], 1),
                        attn_mask.astype(attn_real.dtype))
    residual = jnp.where(is_real, jnp.concatenate([res_real, pad[..., :c.hidden_size]], 1),
                         res_mask.astype(res_real.dtype))
    valid = row[None, :] < (num_real + c.draft_length)[:, None]
    mask = (row[None, :] <= row[:, None])[None] & valid[:, None, :]
    positions = cache.lengths[:, None] + row[None, :]
    cos, sin = layers.rope_cos_sin(positions, self.inv_freq)
    attend_len = cache.capacity if attend_len is None else min(attend_len, cache.capacity)
    attn, k, v = self.midlayer.self_attn(attn_in, cos, sin, cache.k[0], cache.v[0],
                                         cache.lengths, mask, attend_len, attn_impl,
                                         cache.layout)
    h = residual + attn
    out_rows = (num_real - 1)[:, None] + jnp.arange(c.draft_length + 1)[None, :]
    hidden = self.final_hidden(layers.gather_rows(h, out_rows))
    return hidden, cache.replace(k=(k,), v=(v,))


def _ref_name(path: str) -> str:
  """Reference checkpoint name of a ``DartHeadModule`` state path."""
  return (path.replace("/kernel", ".weight").replace("/panels", ".weight")
          .replace("/scale", ".weight").replace("/", "."))


@dataclasses.dataclass(frozen=True, eq=False)
class DartHead:
  """A DART head handle: config + NNX graphdef/params, used functionally.

  tree: the ``TreeConfig`` that ``generate`` uses when it is given none (set for
    the shipped head to the budget measured for it); None = ``TreeConfig()``.
  panel_tree: the one for a target whose dense layers are panels
    (``Target.dense_layout``), where it differs; None = ``tree``. The panel
    form computes up to 6 rows in one register tile, so on such CPUs a 7-token
    verify pass costs a step more than a 6-token one and the shipped head's
    measured tree there has 5 nodes, not 6 (``docs/cpu_performance.md``).
  """

  config: DartConfig
  graphdef: Any
  params: Any
  tree: Any = None
  panel_tree: Any = None

  def default_tree(self, target) -> Any:
    """The tree ``generate`` uses with ``target`` when it is given none."""
    if self.panel_tree is not None and target.dense_layout == "panels":
      return self.panel_tree
    return self.tree

  @classmethod
  def init(cls, target, draft_length: int = 7, draft_vocab_size: int | None = None,
           seed: int = 0, *, double_norm: bool = True) -> "DartHead":
    """A fresh randomly initialised head for ``target`` (a ``Target``).

    With ``draft_vocab_size`` < vocab the draft vocabulary is the first Vd ids
    until a data-derived one is set with ``with_draft_vocab``.
    """
    tc = target.config
    config = DartConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size or tc.vocab_size,
        target_hidden_size=tc.hidden_size, draft_length=draft_length,
        tap_layers=tc.dart_tap_layers, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling, double_norm=double_norm)
    module = DartHeadModule(config, rngs=nnx.Rngs(seed),
                            precision=target.precision.for_drafter())
    graphdef, params = nnx.split(module)
    head = cls(config, graphdef, params)
    if config.draft_vocab_size < config.vocab_size:
      head = head.with_draft_vocab(np.arange(config.draft_vocab_size))
    return sharding_lib.drafter_on_mesh(head, target)

  def module(self) -> DartHeadModule:
    return nnx.merge(self.graphdef, self.params)

  def with_params(self, params) -> "DartHead":
    return dataclasses.replace(self, params=params)

  def with_draft_vocab(self, used_ids) -> "DartHead":
    """Sets the draft vocabulary to the sorted target ids ``used_ids`` [Vd]."""
    used = np.sort(np.asarray(used_ids, np.int64))
    c = self.config
    if used.shape != (c.draft_vocab_size,) or len(np.unique(used)) != len(used):
      raise ConfigError(f"draft vocabulary needs {c.draft_vocab_size} distinct ids, "
                        f"got {used.shape[0]}")
    if used.min() < 0 or used.max() >= c.vocab_size:
      raise ConfigError(f"draft vocabulary ids must lie in [0, {c.vocab_size})")
    t2d = np.zeros(c.vocab_size, bool)
    t2d[used] = True
    module = self.module()
    module.d2t[...] = jnp.asarray(used - np.arange(len(used)), jnp.int32)
    module.t2d[...] = jnp.asarray(t2d)
    return self.with_params(nnx.state(module))

  def check_target(self, target) -> None:
    """Raises ConfigError if this head was built for another target."""
    c, tc = self.config, target.config
    problems = []
    if c.vocab_size != tc.vocab_size:
      problems.append(f"vocab {c.vocab_size} vs target {tc.vocab_size}")
    if c.target_hidden_size != tc.hidden_size:
      problems.append(f"target hidden size {c.target_hidden_size} vs {tc.hidden_size}")
    if c.hidden_size != tc.hidden_size:
      problems.append(f"head hidden size {c.hidden_size} vs target embedding "
                      f"{tc.hidden_size}")
    if max(c.tap_layers) >= tc.num_layers:
      problems.append(f"tap layers {c.tap_layers} vs {tc.num_layers} target layers")
    if problems:
      raise ConfigError("DART head does not fit this target: " + "; ".join(problems))


def save_dart(head: DartHead, path: str | os.PathLike, *, dtype=None) -> None:
  """Writes ``head`` in the reference release's format (config.json +
  model.safetensors; linear weights as [out, in], ``d2t`` as int64 offsets).

  dtype: store floating tensors in this numpy dtype (e.g. ``np.float16`` to halve
  a shipped file); default: as they are.
  """
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  tensors = checkpoint.tensors_from_state(head.params, _ref_name)
  if dtype is not None:
    tensors = {name: t.astype(dtype) if np.issubdtype(t.dtype, np.floating) else t
               for name, t in tensors.items()}
  tensors["d2t"] = tensors["d2t"].astype(np.int64)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(head.config.to_hf(), f, indent=2)


def load_dart(path: str | os.PathLike | None = None, target=None, *, dtype=None
              ) -> DartHead:
  """Loads a DART head from a directory in the reference format.

  Args:
    path: the head directory (config.json + model.safetensors); None = the head
      shipped for the embedded SmolLM2-135M-Instruct target.
    target: the ``Target`` the head will draft for; it supplies the default tap
      layers and is checked against the head. None skips the check (the config
      must then name its tap layers, as heads saved by dart-jax do).
    dtype: the head's ``Precision`` (or its name / a dtype); default its target's
      drafter mode (``Precision.for_drafter``: bf16 rows when the target runs in
      the fast mode), ``precision.default().for_drafter()`` without a target.
  Raises CheckpointError for missing/corrupt files and ConfigError when the head
  does not fit the target (vocabulary, hidden size, layer count).
  """

  shipped = path is None
  path = embedded_dart_dir() if shipped else path
  hf, tensors = read_safetensors_dir(path)
  if target is None and "tap_layers" not in hf.get("dart_jax", {}):
    raise ConfigError(f"{os.fspath(path)}: the config does not name its tap layers; "
                      "pass the target: load_dart(path, target)")
  config = DartConfig.from_hf(hf, target.config if target is not None else None)
  precision = precision_lib.of_drafter(dtype, target)
  graphdef, params = checkpoint.state_from_tensors(
      lambda: DartHeadModule(config, rngs=nnx.Rngs(0), precision=precision), tensors,
      _ref_name, source=os.fspath(path), what="DART head")
  head = DartHead(config, graphdef, params)
  if target is not None:
    head.check_target(target)
  if shipped:
    panel_tree = embedded_tree_config(panels=True)
    head = dataclasses.replace(head, tree=TreeConfig(**embedded_tree_config()),
                               panel_tree=TreeConfig(**panel_tree) if panel_tree else None)
  return sharding_lib.drafter_on_mesh(head, target)
