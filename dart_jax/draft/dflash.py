"""The DFlash block-diffusion drafter and the Domino GRU correction head (DARTree).

See ``docs/algorithms.md``, "DARTree".

- DFlash backbone: the outputs of target layers ``target_layer_ids`` are
  concatenated and turned into a context feature ``hidden_norm(fc(.))`` for
  every committed position. Each Qwen3-style layer (q/k RMSNorm, SwiGLU) takes
  queries from the block ``[root, MASK x (B-1)]`` (embedded with the TARGET's
  embedding) and keys/values from ``concat(context, block)``; attention inside
  the block is bidirectional. Context K/V are cached across rounds (one
  ``KVCache`` with the drafter's layers, indexed by real position); the block's
  K/V are scratch rows past the committed length and are overwritten next round.
  Output: final norm, then the TARGET's lm_head on block slots 1..B-1, giving
  ``base_logits [B-1, V]`` (row i predicts depth i+1 under the root).
- Domino correction head: a one-layer GRU (hidden G, no bias) over the target
  embeddings of the path, and ``embed_proj`` = Linear(H+G -> E), SiLU,
  Linear(E -> V), all without bias:
  ``logits_d(x | path) = base_{d-1}[x] + W2[x] . SiLU(W_z hid_{d-1} + W_s s_{d-1})``.

Checkpoint format (the released ``z-lab/Qwen3-*-DFlash-b16`` and
``Huang2020/Qwen3-*-Domino-b16`` layout, as read from their public modelling
code): a Qwen3 ``config.json`` with top-level ``block_size`` and
``num_target_layers`` and a ``dflash_config`` dict holding ``mask_token_id``,
``target_layer_ids`` and, for Domino, ``projector_type="domino"``, ``emb_dim``,
``gru_hidden_dim`` (optional ``pure_draft_prefix_len``); tensors ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.*`` with Qwen3 names, and
for Domino ``prefix_gru.weight_ih_l0`` [3G, H], ``prefix_gru.weight_hh_l0``
[3G, G] (torch GRU layout, gates r, z, n), ``embed_proj.0.weight`` [E, H+G]
(input order: backbone hidden, then GRU state) and ``embed_proj.2.weight`` [V, E].
There is no embedding and no lm_head: both are the target's.
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax import sharding as sharding_lib
from dart_jax.draft.correction import (CorrectionHead, add_correction_params,
                                       correction_head_of)
from dart_jax.errors import ConfigError
from dart_jax.models import checkpoint, layers
from dart_jax.models import precision as precision_lib
from dart_jax.models.config import RopeScaling, rope_from_hf, rope_inv_freq
from dart_jax.models.precision import Precision
from dart_jax.models.transformer import TOKEN_MAJOR, Attention, KVCache, write_kv
from dart_jax.io import (embedded_dartree_config, embedded_domino_dir, read_safetensors_dir,
                         write_safetensors_dir)
from dart_jax.tree.dartree import DARTreeConfig

PROJECTOR_DOMINO = "domino"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int
                             ) -> tuple[int, ...]:
  """DFlash's default taps: ``round(1 + i*(L-4)/(n-1))`` for i < n (n = 1: L//2).

  Clipped to ``[0, L-1]`` so that tiny targets (L < 5) still get valid layers.
  """
  num_draft_layers = max(int(num_draft_layers), 1)
  if num_draft_layers == 1:
    ids = [num_target_layers // 2]
  else:
    span = num_target_layers - 4
    ids = [int(round(1 + i * span / (num_draft_layers - 1)))
           for i in range(num_draft_layers)]
  return tuple(min(max(i, 0), num_target_layers - 1) for i in ids)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Architecture of a DFlash drafter (optionally with the Domino head).

  hidden_size must equal the target's (the drafter reads target embeddings and
  feeds the target's lm_head). ``block_size`` B: the drafter predicts B-1
  tokens per round. ``target_layer_ids``: target layers whose OUTPUTS form the
  context feature (tap index ``j + 1`` of ``Transformer``).
  ``projector_type="domino"`` adds the correction head (``emb_dim`` E,
  ``gru_hidden_dim`` G); its first ``pure_draft_prefix_len`` depths use the
  uncorrected logits (as the Domino release allows).
  """

  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1000000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 40960
  projector_type: str | None = None
  emb_dim: int = 0
  gru_hidden_dim: int = 0
  pure_draft_prefix_len: int = 0

  def __post_init__(self):
    positive = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "vocab_size")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"DFlash config: {name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"DFlash config: num_attention_heads={self.num_heads} is not a "
                        f"multiple of num_key_value_heads={self.num_kv_heads}")
    if not isinstance(self.block_size, int) or self.block_size < 2:
      raise ConfigError(f"DFlash config: block_size must be an int >= 2 (the root plus "
                        f"at least one mask slot), got {self.block_size!r}")
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise ConfigError(f"DFlash config: mask_token_id={self.mask_token_id} is outside "
                        f"the vocabulary [0, {self.vocab_size})")
    if not self.target_layer_ids or any(
        not isinstance(i, int) or i < 0 for i in self.target_layer_ids):
      raise ConfigError(f"DFlash config: target_layer_ids must be a non-empty list of "
                        f"layer indices >= 0, got {self.target_layer_ids!r}")
    if (self.num_target_layers is not None
        and max(self.target_layer_ids) >= self.num_target_layers):
      raise ConfigError(f"DFlash config: target_layer_ids {list(self.target_layer_ids)} "
                        f"out of range for num_target_layers={self.num_target_layers}")
    if self.projector_type not in (None, PROJECTOR_DOMINO):
      raise ConfigError(f"DFlash config: unsupported projector_type "
                        f"{self.projector_type!r}; supported: none or 'domino'")
    if self.domino:
      if self.emb_dim < 1 or self.gru_hidden_dim < 1:
        raise ConfigError(f"Domino config: emb_dim and gru_hidden_dim must be >= 1, got "
                          f"{self.emb_dim} and {self.gru_hidden_dim}")
      if not 0 <= self.pure_draft_prefix_len < self.block_size:
        raise ConfigError(f"Domino config: pure_draft_prefix_len="
                          f"{self.pure_draft_prefix_len} must be in [0, block_size)")

  @property
  def domino(self) -> bool:
    """Whether the drafter carries the Domino correction head."""
    return self.projector_type == PROJECTOR_DOMINO

  @property
  def num_depths(self) -> int:
    """D = B-1, the draft depths per round."""
    return self.block_size - 1

  @property
  def taps(self) -> tuple[int, ...]:
    """``Transformer`` tap indices of the target layer outputs (layer j -> j+1)."""
    return tuple(j + 1 for j in self.target_layer_ids)

  def to_hf(self) -> dict:
    """config.json in the released DFlash / Domino format."""
    dflash = {"mask_token_id": self.mask_token_id,
              "target_layer_ids": list(self.target_layer_ids)}
    if self.domino:
      dflash.update(projector_type=PROJECTOR_DOMINO, emb_dim=self.emb_dim,
                    gru_hidden_dim=self.gru_hidden_dim,
                    pure_draft_prefix_len=self.pure_draft_prefix_len)
    hf = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "vocab_size": self.vocab_size,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "max_position_embeddings": self.max_position_embeddings,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "block_size": self.block_size,
        "dflash_config": dflash,
    }
    if self.num_target_layers is not None:
      hf["num_target_layers"] = self.num_target_layers
    if self.rope_scaling is not None:
      hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
    return hf

  @classmethod
  def from_hf(cls, hf: dict, target_config=None, source: str = "") -> "DFlashConfig":
    """Reads a released DFlash / Domino config.json.

    Missing ``target_layer_ids`` default from ``num_target_layers`` (or, without
    it, the target's layer count).
    """
    where = f"{source}: " if source else ""
    dflash = hf.get("dflash_config")
    if not isinstance(dflash, dict):
      raise ConfigError(f"{where}config.json has no 'dflash_config' object; is this a "
                        "DFlash / Domino drafter?")
    if dflash.get("shift_label", False):
      raise ConfigError(f"{where}dflash_config.shift_label=true drafters are not "
                        "supported (their slots predict one position later)")
    if hf.get("use_sliding_window", False):
      raise ConfigError(f"{where}sliding-window drafters are not supported "
                        "(use_sliding_window=true)")
    if hf.get("attention_bias", False):
      raise ConfigError(f"{where}attention_bias=true drafters are not supported")
    try:
      num_heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      num_layers = int(hf["num_hidden_layers"])
      theta, scaling = rope_from_hf(hf)
      block_size = hf.get("block_size", dflash.get("block_size"))
      if block_size is None:
        raise KeyError("block_size")
      if dflash.get("mask_token_id") is None:
        raise KeyError("dflash_config.mask_token_id")
      num_target = hf.get("num_target_layers")
      num_target = None if num_target is None else int(num_target)
      ids = dflash.get("target_layer_ids")
      if ids is None:
        n_layers = num_target if num_target is not None else (
            target_config.num_layers if target_config is not None else None)
        if n_layers is None:
          raise KeyError("dflash_config.target_layer_ids (or num_target_layers)")
        ids = default_target_layer_ids(n_layers, num_layers)
      projector = dflash.get("projector_type")
      return cls(
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=num_layers,
          num_heads=num_heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
          head_dim=int(hf.get("head_dim") or hidden // num_heads),
          vocab_size=int(hf["vocab_size"]),
          block_size=int(block_size),
          mask_token_id=int(dflash["mask_token_id"]),
          target_layer_ids=tuple(int(i) for i in ids),
          num_target_layers=num_target,
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          rope_theta=theta,
          rope_scaling=scaling,
          max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
          projector_type=projector,
          emb_dim=int(dflash.get("emb_dim", 0)) if projector else 0,
          gru_hidden_dim=int(dflash.get("gru_hidden_dim", 0)) if projector else 0,
          pure_draft_prefix_len=int(dflash.get("pure_draft_prefix_len", 0) or 0),
      )
    except KeyError as e:
      raise ConfigError(f"{where}DFlash config.json is missing required key "
                        f"{e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
      if isinstance(e, ConfigError):
        raise
      raise ConfigError(f"{where}DFlash config.json has a malformed value: {e}") from e


class DFlashLayer(nnx.Module):
  """One Qwen3-style drafter layer; queries from the block, K/V also from context."""

  def __init__(self, c: DFlashConfig, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.input_layernorm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps,
                                          precision=precision)
    self.self_attn = Attention(
        in_features=c.hidden_size, out_features=c.hidden_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, qk_norm=True,
        eps=c.rms_norm_eps, rngs=rngs, precision=precision)
    self.post_attention_layernorm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps,
                                                   precision=precision)
    self.mlp = layers.SwiGLU(c.hidden_size, c.intermediate_size, rngs=rngs,
                             precision=precision)

  def context_kv(self, ctx: jax.Array, cos: jax.Array, sin: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Context feature [B, C, H] -> (k, v) [B, C, Hkv, hd] (k normed and rotated).

    The context enters every layer as is: no input_layernorm, as in DFlash.
    """
    attn = self.self_attn
    b, c, _ = ctx.shape
    k = attn.k_proj(ctx).reshape(b, c, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(ctx).reshape(b, c, attn.num_kv_heads, attn.head_dim)
    k = layers.apply_rope(attn.k_norm(k), cos, sin)
    return k, v

  def __call__(self, x, cos, sin, k_cache, v_cache, lengths, mask, attend_len, attn_impl,
               cache_layout=TOKEN_MAJOR):
    attn, k_cache, v_cache = self.self_attn(
        self.input_layernorm(x), cos, sin, k_cache, v_cache, lengths, mask, attend_len,
        attn_impl, cache_layout)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, k_cache, v_cache


class DFlashModule(nnx.Module):
  """NNX parameters of a DFlash drafter (+ Domino head) and its forward passes."""

  def __init__(self, c: DFlashConfig, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.config = c
    self.precision = precision_lib.resolve(precision)
    # Domino's GRU and projections are small and feed float32 tree-building
    # math: they keep the compute dtype (no per-call weight casts).
    small = self.precision.uniform()
    h = c.hidden_size
    self.fc = layers.linear(len(c.target_layer_ids) * h, h, rngs=rngs,
                            precision=precision)
    self.hidden_norm = layers.RMSNorm(h, c.rms_norm_eps, precision=precision)
    self.layers = nnx.List([DFlashLayer(c, rngs=rngs, precision=precision)
                            for _ in range(c.num_layers)])
    self.norm = layers.RMSNorm(h, c.rms_norm_eps, precision=precision)
    if c.domino:
      add_correction_params(self, h, c.gru_hidden_dim, c.emb_dim, c.vocab_size, rngs=rngs,
                            precision=small)
    self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, c.rope_theta,
                                                          c.rope_scaling))

  def context(self, taps: jax.Array) -> jax.Array:
    """taps [..., n*Ht] (target layer outputs) -> context feature [..., H]."""
    return self.hidden_norm(self.fc(taps))

  def write_context(self, taps: jax.Array, cache: KVCache) -> KVCache:
    """Writes context K/V of C new positions at ``cache.lengths`` (not advanced).

    taps: [B, C, n*Ht] at positions ``lengths .. lengths+C-1`` (right-padded;
    rows past the real count are scratch that later writes overwrite).
    """
    ctx = self.context(taps)
    positions = cache.lengths[:, None] + jnp.arange(ctx.shape[1])[None, :]
    cos, sin = layers.rope_cos_sin(positions, self.inv_freq)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      k, v = layer.context_kv(ctx, cos, sin)
      new_k.append(write_kv(cache.k[i], k, cache.lengths, cache.layout))
      new_v.append(write_kv(cache.v[i], v, cache.lengths, cache.layout))
    return cache.replace(k=tuple(new_k), v=tuple(new_v))

  def block(self, embeds: jax.Array, cache: KVCache, *, attend_len: int | None = None,
            attn_impl: str = "auto") -> tuple[jax.Array, KVCache]:
    """Runs the block ``[root, MASK...]`` at positions ``lengths + i``.

    embeds: [B, T, H] target embeddings of the block. The block sees the first
    ``lengths`` context rows and itself (bidirectionally). Its K/V are written
    at ``lengths`` as scratch (lengths not advanced: they are dropped).
    Returns (normed hidden [B, T, H], cache).
    """
    batch, t, _ = embeds.shape
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    cos, sin = layers.rope_cos_sin(positions, self.inv_freq)
    mask = jnp.ones((batch, t, t), bool)
    attend_len = cache.capacity if attend_len is None else min(attend_len, cache.capacity)
    x = embeds.astype(self.precision.dtype)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      x, k, v = layer(x, cos, sin, cache.k[i], cache.v[i], cache.lengths, mask,
                      attend_len, attn_impl, cache.layout)
      new_k.append(k)
      new_v.append(v)
    return self.norm(x), cache.replace(k=tuple(new_k), v=tuple(new_v))

  def forward_masked(self, taps: jax.Array, embeds: jax.Array, block_positions: jax.Array,
                     mask: jax.Array) -> jax.Array:
    """Cache-free pass under an explicit mask (the training hook).

    taps: [B, S, n*Ht] context at positions 0..S-1; embeds: [B, T, H] block
    tokens at ``block_positions [B, T]``; mask: [B, T, S+T] which context rows
    and block tokens each block token sees (``dflash_block_mask``). Returns
    the normed hidden [B, T, H]; with one block and a full mask it equals
    ``block`` on a cache holding the same context.
    """
    ctx = self.context(taps)
    ctx_positions = jnp.broadcast_to(jnp.arange(ctx.shape[1]), ctx.shape[:2])
    cos_c, sin_c = layers.rope_cos_sin(ctx_positions, self.inv_freq)
    cos_b, sin_b = layers.rope_cos_sin(block_positions, self.inv_freq)
    x = embeds.astype(self.precision.dtype)
    b, t, _ = x.shape
    for layer in self.layers:
      attn = layer.self_attn
      h = layer.input_layernorm(x)
      q = attn.q_norm(attn.q_proj(h).reshape(b, t, attn.num_heads, attn.head_dim))
      k = attn.k_norm(attn.k_proj(h).reshape(b, t, attn.num_kv_heads, attn.head_dim))
      v = attn.v_proj(h).reshape(b, t, attn.num_kv_heads, attn.head_dim)
      q, k = layers.apply_rope(q, cos_b, sin_b), layers.apply_rope(k, cos_b, sin_b)
      k_ctx, v_ctx = layer.context_kv(ctx, cos_c, sin_c)
      out = _masked_attention(q, jnp.concatenate([k_ctx, k], 1),
                              jnp.concatenate([v_ctx, v], 1), mask)
      x = x + attn.o_proj(out.reshape(b, t, -1))
      x = x + layer.mlp(layer.post_attention_layernorm(x))
    return self.norm(x)

  def correction_head(self, embed_table: jax.Array, hidden: jax.Array) -> CorrectionHead:
    """The Domino head as plain float32 arrays for the tree builders.

    embed_table: [V, H] the target's embedding; hidden: [..., D, H] the normed
    backbone outputs of slots 1..B-1 (``hid``). ``W_z hid`` is computed here,
    once per round.
    """
    return correction_head_of(self, embed_table, hidden,
                              num_uncorrected=self.config.pure_draft_prefix_len)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                      ) -> jax.Array:
  """GQA attention with an explicit mask, softmax in float32.

  q: [B, T, Hq, hd]; k, v: [B, S, Hkv, hd]; mask: [B, T, S]. A row that sees
  nothing gives zeros.
  """
  b, t, hq, hd = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, hd).astype(jnp.float32) * hd ** -0.5
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))
  visible = mask[:, None, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
  return out.reshape(b, t, hq, hd).astype(q.dtype)


def dflash_block_mask(anchors: jax.Array, num_context: int, block_size: int) -> jax.Array:
  """DFlash's training mask for blocks anchored at ``anchors [B, nb]``.

  Block j holds positions ``anchors[j] .. anchors[j]+B-1`` (its first token is
  the anchor, the root); it sees the context rows before its anchor and its own
  tokens (bidirectionally), no other block. Returns [B, nb*B, S + nb*B] bool,
  block tokens in block-major order.
  """
  batch, num_blocks = anchors.shape
  t = num_blocks * block_size
  block_of = jnp.arange(t) // block_size  # [T]
  sees_ctx = jnp.arange(num_context)[None, None, :] < jnp.repeat(
      anchors, block_size, axis=1)[:, :, None]  # [B, T, S]
  sees_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (batch, t, t))
  return jnp.concatenate([sees_ctx, sees_block], axis=-1)


def draft_block(target_model, drafter: DFlashModule, root: jax.Array, cache: KVCache, *,
                attend_len: int | None, attn_impl: str
                ) -> tuple[jax.Array, jax.Array, KVCache]:
  """One backbone pass for roots [B] at positions ``cache.lengths``.

  Returns (base_logits [B, D, V] float32, hidden [B, D, H] of slots 1..B-1,
  cache with the block's scratch rows).
  """
  c = drafter.config
  batch = root.shape[0]
  mask_ids = jnp.full((batch, c.block_size - 1), c.mask_token_id, jnp.int32)
  block_ids = jnp.concatenate([root[:, None].astype(jnp.int32), mask_ids], axis=1)
  hidden, cache = drafter.block(target_model.embed(block_ids), cache,
                                attend_len=attend_len, attn_impl=attn_impl)
  hidden = hidden[:, 1:]
  # The target's LM head without its final norm (DFlash normalises itself),
  # in the drafter's mode.
  return target_model.lm_head_logits(hidden, drafter.precision), hidden, cache


# Released tensor name for each NNX state path of ``DFlashModule``.
_RELEASED_NAME_RULES = (
    (r"fc/(kernel|weight|panels)", "fc.weight"),
    (r"hidden_norm/scale", "hidden_norm.weight"),
    (r"norm/scale", "norm.weight"),
    (r"layers/(\d+)/(self_attn|mlp)/(\w+_proj)/(kernel|weight|panels)",
     r"layers.\1.\2.\3.weight"),
    (r"layers/(\d+)/self_attn/(q_norm|k_norm)/scale", r"layers.\1.self_attn.\2.weight"),
    (r"layers/(\d+)/(\w+_layernorm)/scale", r"layers.\1.\2.weight"),
    (r"prefix_gru/input_kernel", "prefix_gru.weight_ih_l0"),
    (r"prefix_gru/hidden_kernel", "prefix_gru.weight_hh_l0"),
    (r"embed_proj_in/kernel", "embed_proj.0.weight"),
    (r"embed_proj_out/kernel", "embed_proj.2.weight"),
)


# NNX state path (``layers/0/mlp/up_proj/kernel``) -> released tensor name.
released_name = checkpoint.renamer(_RELEASED_NAME_RULES)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashDrafter:
  """A DFlash drafter (with or without the Domino head), used functionally.

  ``generate(target, prompt, draft=drafter, tree=...)`` decodes with it; tree
  methods: "dartree" (pruned, default), "dartree-fixed", "ddtree", "chain"
  (Domino chain with the head, DFlash chain without), "dflash-chain",
  "domino-chain". See ``dart_jax.decode.dartree``.

  tree_config: the ``DARTreeConfig`` that ``generate`` uses when it is given
  none (set for the shipped drafter: the settings measured for it); None =
  ``DARTreeConfig()``.
  """

  config: DFlashConfig
  graphdef: Any
  params: Any
  tree_config: DARTreeConfig | None = None

  @classmethod
  def init(cls, target, *, block_size: int = 16, num_layers: int = 1,
           domino: bool = False, seed: int = 0, emb_dim: int = 32,
           gru_hidden_dim: int = 32, intermediate_size: int | None = None,
           target_layer_ids: tuple[int, ...] | None = None,
           mask_token_id: int | None = None) -> "DFlashDrafter":
    """A randomly initialised drafter for ``target`` (tests, training start).

    Heads and head_dim follow the target; the mask token defaults to the last
    vocabulary id; taps default to DFlash's rule with n = num_layers taps.
    """
    tc = target.config
    config = DFlashConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_layers=num_layers, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim, vocab_size=tc.vocab_size, block_size=block_size,
        mask_token_id=tc.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(
            tc.num_layers, num_layers)),
        num_target_layers=tc.num_layers, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
        max_position_embeddings=tc.max_position_embeddings,
        projector_type=PROJECTOR_DOMINO if domino else None,
        emb_dim=emb_dim if domino else 0, gru_hidden_dim=gru_hidden_dim if domino else 0)
    module = DFlashModule(config, rngs=nnx.Rngs(seed),
                          precision=target.precision.for_drafter())
    graphdef, params = nnx.split(module)
    return sharding_lib.drafter_on_mesh(cls(config, graphdef, params), target)

  @property
  def domino(self) -> bool:
    return self.config.domino

  def module(self) -> DFlashModule:
    return nnx.merge(self.graphdef, self.params)

  def with_params(self, params) -> "DFlashDrafter":
    return dataclasses.replace(self, params=params)

  def check_target(self, target) -> None:
    """Raises ConfigError if this drafter does not fit ``target``."""
    c, tc = self.config, target.config
    problems = []
    if c.hidden_size != tc.hidden_size:
      problems.append(f"drafter hidden size {c.hidden_size} vs target {tc.hidden_size} "
                      "(the drafter reads target embeddings and feeds its lm_head)")
    if c.vocab_size != tc.vocab_size:
      problems.append(f"vocab {c.vocab_size} vs target {tc.vocab_size}")
    if max(c.target_layer_ids) >= tc.num_layers:
      problems.append(f"target_layer_ids {list(c.target_layer_ids)} vs "
                      f"{tc.num_layers} target layers")
    if c.num_target_layers is not None and c.num_target_layers != tc.num_layers:
      problems.append(f"num_target_layers {c.num_target_layers} vs {tc.num_layers} "
                      "target layers")
    if problems:
      raise ConfigError("DFlash drafter does not fit this target: " + "; ".join(problems)
                        + "; load the drafter made for this target")


def save_dflash(drafter: DFlashDrafter, path: str | os.PathLike, *, dtype=np.float32
                ) -> None:
  """Writes ``drafter`` in the released format (config.json + model.safetensors,
  linear weights [out, in], GRU weights in torch layout), weights in ``dtype``
  (float16 for a shipped file: half the bytes)."""

  tensors = checkpoint.tensors_from_state(drafter.params, released_name)
  tensors = {k: v.astype(dtype) for k, v in tensors.items()}
  write_safetensors_dir(path, drafter.config.to_hf(), tensors)


def load_dflash(path: str | os.PathLike | None = None, target=None, *, dtype=None
                ) -> DFlashDrafter:
  """Loads a DFlash or Domino drafter for ``target`` from a released-format dir.

  Args:
    path: the drafter directory (config.json + model.safetensors); None = the
      Domino drafter shipped for the embedded SmolLM2-135M-Instruct target, with
      its measured DARTree settings attached (``DFlashDrafter.tree_config``).
    target: the ``Target`` the drafter drafts for (required: the drafter reads
      its embedding, lm_head and layer outputs).
    dtype: the drafter's ``Precision``; default its target's drafter mode.
  Raises CheckpointError for missing / corrupt / mis-shaped tensors and
  ConfigError for a config that is invalid or does not fit the target.
  """

  if target is None:
    raise ConfigError("load_dflash / load_domino need the target the drafter drafts "
                      "for: load_domino(path, target) (path None = the shipped drafter)")
  shipped = path is None
  path = os.fspath(embedded_domino_dir() if shipped else path)
  hf, tensors = read_safetensors_dir(path)
  config = DFlashConfig.from_hf(hf, target.config, source=path)
  drafter = _from_tensors(config, tensors, precision_lib.of_drafter(dtype, target), path)
  drafter.check_target(target)
  if shipped:
    drafter = dataclasses.replace(drafter,
                                  tree_config=DARTreeConfig(**embedded_dartree_config()))
  return sharding_lib.drafter_on_mesh(drafter, target)


def load_domino(path: str | os.PathLike | None = None, target=None, *, dtype=None
                ) -> DFlashDrafter:
  """Like ``load_dflash`` but requires the Domino correction head (path None =
  the drafter shipped for the embedded target)."""
  drafter = load_dflash(path, target, dtype=dtype)
  if not drafter.domino:
    raise ConfigError(f"{path}: dflash_config.projector_type is "
                      f"{drafter.config.projector_type!r}, not 'domino'; this is a "
                      "plain DFlash drafter (use load_dflash)")
  return drafter


def _from_tensors(config: DFlashConfig, tensors: dict, precision, source: str
                  ) -> DFlashDrafter:
  graphdef, params = checkpoint.state_from_tensors(
      lambda: DFlashModule(config, rngs=nnx.Rngs(0), precision=precision), tensors,
      released_name, source=os.fspath(source), what="DFlash / Domino drafter")
  return DFlashDrafter(config, graphdef, params)
