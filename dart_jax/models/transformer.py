"""Llama / Qwen3 (and their MoE variants) in Flax NNX, with a preallocated per-layer
KV cache.

Every call is the same operation: T new tokens at given positions attend to the
first ``cache.lengths[b]`` cache entries plus the new tokens their ``tree_mask``
row allows. Prefill is a causal mask, decode is T=1, tree verification is an
ancestor mask. The new K/V are written at ``cache.lengths`` (per sequence);
``lengths`` itself is not advanced here, the caller decides how many of the new
entries become committed (all for prefill/decode, the accepted path for trees,
see ``KVCache.compact``).
"""

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dart_jax import sharding as sharding_lib
from dart_jax.models import layers
from dart_jax.models import precision as precision_lib
from dart_jax.models.config import ModelConfig, rope_inv_freq
from dart_jax.models.moe import MoE
from dart_jax.models.precision import Precision
from kernels import cpu_matmul
from kernels.tree_attention import TOKEN_MAJOR, cache_layout_for, tree_attention
from kernels.tree_attention import common as attention_common
from kernels.tree_attention.ops import cpu_kernel_runs, resolve_impl


@flax.struct.dataclass
class KVCache:
  """Per-layer key/value buffers and the committed length of each sequence.

  k, v: tuples of L arrays (one buffer per layer so a decoding step updates each
    in place when the cache is donated): [B, S, Hkv, hd] token-major (the
    Pallas kernels' layout) or [B, Hkv, S, hd] head-major (the XLA path's;
    ``kernels.tree_attention.common`` says why, ``cache_layout_for(attn_impl)``
    which one an implementation reads).
  lengths: [B] int32, committed entries per sequence.
  layout: ``TOKEN_MAJOR`` ("bshd") or ``HEAD_MAJOR`` ("bhsd"), static.
  sharding: on a mesh, the buffers' ``NamedSharding`` (batch over "data",
    key/value heads over "tensor"; ``dart_jax.sharding.cache_spec``), static;
    every call that writes the cache keeps it. None on one device.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array
  layout: str = flax.struct.field(pytree_node=False, default=TOKEN_MAJOR)
  sharding: Any = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, *, layout: str | None = None,
             mesh: jax.sharding.Mesh | None = None, split_heads: bool = False
             ) -> "KVCache":
    """An empty cache; ``layout`` defaults to what ``attn_impl="auto"`` reads on
    this backend. With ``mesh`` the buffers are made sharded (batch over "data",
    key/value heads over "tensor" if ``split_heads``)."""
    layout = cache_layout_for("auto") if layout is None else layout
    shape = attention_common.buffer_shape(layout, batch, capacity, num_kv_heads, head_dim)
    sharding = lengths_sharding = None
    if mesh is not None:
      head_axis = 2 if layout == TOKEN_MAJOR else 1
      sharding = NamedSharding(mesh, sharding_lib.cache_spec(mesh, shape, head_axis,
                                                             split_heads))
      lengths_sharding = NamedSharding(mesh, sharding_lib.batch_spec(mesh, batch, 1))
    buffers = lambda: tuple(sharding_lib.zeros(shape, dtype, sharding)
                            for _ in range(num_layers))
    return cls(k=buffers(), v=buffers(),
               lengths=sharding_lib.zeros((batch,), jnp.int32, lengths_sharding),
               layout=layout, sharding=sharding)

  @classmethod
  def for_attention(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
                    head_dim: int, dtype, attn_impl: str, *,
                    mesh: jax.sharding.Mesh | None = None, split_heads: bool = False
                    ) -> "KVCache":
    """An empty cache in the layout ``attn_impl`` (":interpret" allowed) reads."""
    return cls.create(num_layers, batch, capacity, num_kv_heads, head_dim, dtype,
                      layout=cache_layout_for(attn_impl.partition(":")[0]), mesh=mesh,
                      split_heads=split_heads)

  def constrained(self) -> "KVCache":
    """The cache with its buffers pinned to ``sharding`` (inside jit), so the
    output of a call lives where its input did; a no-op on one device."""
    if self.sharding is None:
      return self
    pin = lambda b: jax.lax.with_sharding_constraint(b, self.sharding)
    return self.replace(k=tuple(map(pin, self.k)), v=tuple(map(pin, self.v)))

  @property
  def capacity(self) -> int:
    return self.v[0].shape[attention_common.seq_axis(self.layout)]

  def compact(self, accepted_index: jax.Array, accepted_len: jax.Array) -> "KVCache":
    """Keeps an accepted path of the entries last written at ``lengths``.

    Args:
      accepted_index: [B, A] offsets (from ``lengths``) of the accepted entries in
        path order; entries past ``accepted_len`` are ignored.
      accepted_len: [B] number of accepted entries.
    Returns:
      The cache with the accepted entries moved to ``lengths .. lengths+len-1`` and
      ``lengths`` advanced by ``accepted_len``.
    """
    src = self.lengths[:, None] + accepted_index

    def move(buf):
      return write_kv(buf, read_kv(buf, src, self.layout), self.lengths, self.layout)

    return self.replace(k=tuple(move(b) for b in self.k), v=tuple(move(b) for b in self.v),
                        lengths=self.lengths + accepted_len.astype(jnp.int32)).constrained()

  def grow(self, capacity: int) -> "KVCache":
    """The cache with ``capacity`` rows (at least the current ones); the new
    rows are empty and every committed entry stays where it was."""
    extra = capacity - self.capacity
    if extra < 0:
      raise ValueError(f"a cache of {self.capacity} rows cannot shrink to {capacity}")
    if extra == 0:
      return self
    axis = attention_common.seq_axis(self.layout)

    def pad(buf):
      widths = [(0, 0)] * buf.ndim
      widths[axis] = (0, extra)
      return jnp.pad(buf, widths)

    return self.replace(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v))).constrained()

  def take_rows(self, index: jax.Array) -> "KVCache":
    """The cache of sequences ``index [B']`` (rows of the batch, repeats
    allowed): a smaller batch when some sequences have finished. One device
    only (a sharded cache keeps its batch size)."""
    if self.sharding is not None:
      raise ValueError("take_rows changes the batch size; a sharded cache cannot")
    take = lambda b: jnp.take(b, index, axis=0)
    return self.replace(k=tuple(map(take, self.k)), v=tuple(map(take, self.v)),
                        lengths=self.lengths[index])


@functools.partial(jax.jit, static_argnames=("extra_rows",))
def grow_caches(tree: Any, extra_rows: int) -> Any:
  """``tree`` (a decoder's state) with every ``KVCache`` in it ``extra_rows``
  rows longer (``KVCache.grow``); other leaves unchanged.

  ``generate`` starts caches at the rows the first rounds read and grows them
  as the sequences lengthen: XLA attention then reads its whole buffer rather
  than a prefix, which XLA:CPU copies per layer and call (on the 2-core CPU,
  B=128 and a 256-row window in a 512-row cache, the copies took 126 of a
  decode step's 530 ms; at B=1, 1.8 of 17 ms).
  """
  is_cache = lambda node: isinstance(node, KVCache)
  return jax.tree.map(lambda node: node.grow(node.capacity + extra_rows) if is_cache(node)
                      else node, tree, is_leaf=is_cache)


def write_kv(buf: jax.Array, rows: jax.Array, start: jax.Array, layout: str) -> jax.Array:
  """Writes ``rows [B, T, Hkv, hd]`` at positions ``start[b] ..`` of one layer's
  key or value buffer in ``layout`` (``layers.write_rows`` on its position axis)."""
  return layers.write_rows(buf, rows, start, attention_common.seq_axis(layout))


def read_kv(buf: jax.Array, positions: jax.Array, layout: str) -> jax.Array:
  """Entries ``positions [B, J]`` of one layer's key or value buffer ->
  [B, J, Hkv, hd]."""
  return layers.gather_rows(buf, positions, attention_common.seq_axis(layout))


# A static prefix of the cache is a copy on XLA:CPU (a dot reads its operands
# whole), about as costly as attending over twice as many rows. SmolLM2-135M,
# B=128, one decode step over a 768-row cache: a 256-row prefix 0.52 s vs the
# whole buffer 0.76 s, a 512-row prefix 0.62-0.94 s vs the whole 0.62 s.
PREFIX_PAYS_FROM = 2


def prefix_pays(attend_len: int | None, capacity: int) -> bool:
  """Whether XLA attention should read ``cache[:attend_len]`` rather than the
  whole ``capacity`` rows (the length mask makes both exact): when the buffer
  is at least ``PREFIX_PAYS_FROM`` times longer."""
  return attend_len is not None and capacity >= PREFIX_PAYS_FROM * attend_len


def cache_prefix(buf: jax.Array, length: int, layout: str) -> jax.Array:
  """The first ``length`` positions of a key or value buffer (static slice)."""
  index = [slice(None)] * buf.ndim
  index[attention_common.seq_axis(layout)] = slice(0, length)
  return buf[tuple(index)]


def per_shard(attention, sharding: NamedSharding):
  """``attention`` (``tree_attention`` with its options bound) run on each
  device's rows and heads of a cache sharded as ``sharding`` (token-major
  [B, S, Hkv, hd]).

  XLA cannot split a Pallas kernel; ``shard_map`` hands each device its slice
  instead: rows over "data", query and key/value heads over "tensor" when the
  cache splits them. Each head's attention is independent, so the result is
  the unsharded one.
  """
  spec = sharding.spec
  rows = spec[0] if len(spec) > 0 else None
  heads = spec[2] if len(spec) > 2 else None
  q_spec = P(rows, None, heads, None)
  kv_spec = P(rows, None, heads, None)
  return jax.shard_map(
      attention, mesh=sharding.mesh,
      in_specs=(q_spec, kv_spec, kv_spec, P(rows), kv_spec, kv_spec, P(rows, None, None)),
      out_specs=q_spec, check_vma=False)


class ModelOutput(NamedTuple):
  """logits: [B, K, V] float32 (K = rows asked for); taps: [B, T, n*H] or None."""

  logits: jax.Array | None
  cache: KVCache
  taps: jax.Array | None


class Attention(nnx.Module):
  """Multi-head attention with GQA, RoPE, optional q/k RMSNorm (Qwen3), on a cache."""

  def __init__(self, *, in_features: int, out_features: int, num_heads: int,
               num_kv_heads: int, head_dim: int, qk_norm: bool = False,
               eps: float = 1e-6, use_bias: bool = False, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    kw = dict(rngs=rngs, precision=precision, use_bias=use_bias)
    self.q_proj = layers.linear(in_features, num_heads * head_dim, **kw)
    self.k_proj = layers.linear(in_features, num_kv_heads * head_dim, **kw)
    self.v_proj = layers.linear(in_features, num_kv_heads * head_dim, **kw)
    self.o_proj = layers.linear(num_heads * head_dim, out_features, rngs=rngs,
                                precision=precision)
    if qk_norm:
      self.q_norm = layers.RMSNorm(head_dim, eps, precision=precision)
      self.k_norm = layers.RMSNorm(head_dim, eps, precision=precision)
    self.qk_norm = qk_norm
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

  def __call__(self, x, cos, sin, k_cache, v_cache, lengths, tree_mask, attend_len,
               attn_impl, cache_layout=TOKEN_MAJOR, sharding=None):
    """x: [B, T, in]; caches in ``cache_layout`` (see ``KVCache``) ->
    (out [B, T, out], k_cache, v_cache).

    The T new tokens see ``cache[:lengths]`` and the new tokens ``tree_mask``
    allows; their K/V are then written at ``lengths``. ``sharding``: the
    cache's (``KVCache.sharding``); a Pallas kernel then runs per shard.
    """
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    if k_cache is None:  # Cache-free pass (training): a one-row empty cache.
      empty = jnp.zeros((b, 1, self.num_kv_heads, self.head_dim), k.dtype)
      impl, _, mode = attn_impl.partition(":")
      out = tree_attention(q, empty, empty, jnp.zeros((b,), jnp.int32), k, v, tree_mask,
                           impl=impl, interpret=mode == "interpret")
      return self.o_proj(out.reshape(b, t, -1)), None, None
    impl, _, mode = attn_impl.partition(":")
    layout = cache_layout  # Shorter below.
    # Write first, then read: reading the old buffer after an in-place update
    # would make XLA copy the whole cache every call.
    k_cache = write_kv(k_cache, k, lengths, layout)
    v_cache = write_kv(v_cache, v, lengths, layout)
    if (resolve_impl(impl) == "xla"
        and not cpu_kernel_runs(t, self.head_dim, k_cache.dtype, layout)
        and prefix_pays(attend_len, k_cache.shape[attention_common.seq_axis(layout)])):
      # XLA reads every cache row it is given: bound the work by attend_len
      # (>= max length). The kernels (Pallas, CPU) skip padding themselves, and
      # a slice would cost them a copy.
      k_cache_read = cache_prefix(k_cache, attend_len, layout)
      v_cache_read = cache_prefix(v_cache, attend_len, layout)
    else:
      k_cache_read, v_cache_read = k_cache, v_cache
    attention = functools.partial(tree_attention, impl=impl, interpret=mode == "interpret",
                                  cache_layout=layout)
    if sharding is not None and resolve_impl(impl) != "xla":
      attention = per_shard(attention, sharding)
    out = attention(q, k_cache_read, v_cache_read, lengths, k.astype(k_cache.dtype),
                    v.astype(v_cache.dtype), tree_mask)
    return self.o_proj(out.reshape(b, t, -1)), k_cache, v_cache


class Block(nnx.Module):
  """Pre-norm decoder layer."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32, sparse: bool = False):
    self.input_layernorm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps,
                                          precision=precision)
    c = config
    self.self_attn = Attention(
        in_features=c.hidden_size, out_features=c.hidden_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, qk_norm=c.qk_norm,
        eps=c.rms_norm_eps, use_bias=c.attention_bias, rngs=rngs, precision=precision)
    self.post_attention_layernorm = layers.RMSNorm(
        config.hidden_size, config.rms_norm_eps, precision=precision)
    if sparse:
      self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                     c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, rngs=rngs,
                     precision=precision)
    else:
      self.mlp = layers.SwiGLU(c.hidden_size, c.intermediate_size, rngs=rngs,
                               precision=precision)

  def __call__(self, x, cos, sin, k_cache, v_cache, lengths, tree_mask, attend_len,
               attn_impl, cache_layout=TOKEN_MAJOR, sharding=None):
    attn, k_cache, v_cache = self.self_attn(
        self.input_layernorm(x), cos, sin, k_cache, v_cache, lengths, tree_mask,
        attend_len, attn_impl, cache_layout, sharding)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, k_cache, v_cache


class Transformer(nnx.Module):
  """A Llama-family or Qwen3 causal LM."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.config = config
    self.precision = precision_lib.resolve(precision)
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size,
                                  param_dtype=self.precision.weight_dtype,
                                  embedding_init=layers.normal_init(0.02), rngs=rngs)
    self.layers = nnx.List([Block(config, rngs=rngs, precision=precision,
                                  sparse=config.is_sparse(i))
                            for i in range(config.num_layers)])
    self.norm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps,
                               precision=precision)
    if not config.tie_embeddings:
      self.lm_head = layers.linear(config.hidden_size, config.vocab_size, rngs=rngs,
                                   precision=precision)
    elif precision_lib.weight_layout(self.precision, config.vocab_size) == "panels":
      # The tied LM head as panels too: a packed copy of the embedding table
      # (checkpoints load both from the one tensor), for the kernel's panel form.
      self.tied_head = layers.Dense(config.hidden_size, config.vocab_size, rngs=nnx.Rngs(0),
                                    precision=precision)
      self.tied_head.panels = nnx.Param(
          cpu_matmul.to_panels(self.embed_tokens.embedding[...]))
    self.inv_freq = tuple(float(f) for f in rope_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling))

  def embed(self, tokens: jax.Array) -> jax.Array:
    """tokens [...] -> [..., H] in the compute dtype."""
    return self.embed_tokens(tokens).astype(self.precision.dtype)

  def lm_head_logits(self, hidden: jax.Array, precision: Precision | None = None
                     ) -> jax.Array:
    """The LM head alone (tied or untied), no final norm: [..., H] -> [..., V] f32.

    precision: the caller's mode (a drafter reading the target's head passes its
    own); default the target's.
    """
    precision = precision or self.precision
    if hasattr(self, "tied_head"):
      out = self.tied_head.apply(hidden, precision)
    elif self.config.tie_embeddings:
      out = precision_lib.matmul(hidden, self.embed_tokens.embedding[...], precision,
                                 transposed=True)
    else:
      out = self.lm_head.apply(hidden, precision)
    return out.astype(jnp.float32)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final norm + LM head in float32. hidden [..., H] -> [..., V]."""
    return self.lm_head_logits(self.norm(hidden))

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      cache: KVCache,
      tree_mask: jax.Array,
      *,
      attend_len: int | None = None,
      taps: tuple[int, ...] = (),
      logit_rows: jax.Array | None = None,
      attn_impl: str = "auto",
  ) -> ModelOutput:
    """Runs T new tokens per sequence against the cache.

    Args:
      tokens: [B, T] int32.
      positions: [B, T] int32 RoPE positions.
      cache: the KV cache; new K/V are written at ``cache.lengths``. None runs a
        cache-free pass where tokens see only each other (training).
      tree_mask: [B, T, T] bool; row i says which new tokens token i sees.
      attend_len: static bound on ``max(cache.lengths)``; only that many cache rows
        are read (default: the whole cache).
      taps: residual-stream indices to return, as HF ``hidden_states``: index i is
        the input of layer i (0 = embeddings), index L the output of the last
        layer before the final norm. DART reads the inputs of layers 2, L//2, L-3;
        DFlash the outputs of its target layers (index layer+1).
      logit_rows: [B, K] rows of T to compute logits for; None = all T rows.
        Pass an empty [B, 0] array to skip the LM head.
      attn_impl: tree_attention implementation ("auto", "xla", "pallas_tpu",
        "pallas_gpu"); a ":interpret" suffix runs a Pallas kernel in interpret
        mode (CPU tests).
    Returns:
      ModelOutput(logits [B, K, V] float32, cache, taps [B, T, len(taps)*H]).
    """
    if cache is not None:
      attend_len = cache.capacity if attend_len is None else min(attend_len, cache.capacity)
    cos, sin = layers.rope_cos_sin(positions, self.inv_freq)
    x = self.embed(tokens)
    hidden_states = [x]
    new_k, new_v = [], []
    for i, block in enumerate(self.layers):
      if cache is None:
        x, k, v = block(x, cos, sin, None, None, None, tree_mask, None, attn_impl)
      else:
        x, k, v = block(x, cos, sin, cache.k[i], cache.v[i], cache.lengths, tree_mask,
                        attend_len, attn_impl, cache.layout, cache.sharding)
      new_k.append(k)
      new_v.append(v)
      hidden_states.append(x)
    tap_out = (jnp.concatenate([hidden_states[i] for i in taps], axis=-1)
               if taps else None)
    if logit_rows is not None:
      x = layers.gather_rows(x, logit_rows)
    logits = self.logits(x) if x.shape[1] else None
    if cache is not None:
      cache = cache.replace(k=tuple(new_k), v=tuple(new_v)).constrained()
    return ModelOutput(logits=logits, cache=cache, taps=tap_out)


def causal_mask(batch: int, length: int) -> jax.Array:
  """[B, T, T] lower-triangular mask."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)),
                          (batch, length, length))
