"""Pure-jnp tree attention: the ground truth for the Pallas kernels.

Each of the T new ("tree") tokens attends to the first ``lengths[b]`` entries of
the KV cache and to the tree tokens its ``tree_mask`` row allows. Prefill (causal
mask), decode (T=1) and tree verification are all this one operation.
"""

import functools

import jax
import jax.numpy as jnp

from kernels import cpu_matmul
from kernels.tree_attention import common


def _scores_kernel_runs(k_cache: jax.Array, token_major: bool) -> bool:
  """Whether the cache scores go through ``kernels.cpu_matmul``: on the CPU
  backend, head-major float32 / bf16 keys, where the kernel is built.

  XLA:CPU's batched dot of a few query rows against each (row, KV head)'s keys
  read them at 3-4 GB/s (B=128, 3 KV heads, 256 rows: 6.9 ms; the kernel 0.8).
  """
  return (not token_major and jax.default_backend() == "cpu"
          and k_cache.dtype in (jnp.float32, jnp.bfloat16) and cpu_matmul.available())


def _cache_scores(qg: jax.Array, k_cache: jax.Array, token_major: bool) -> jax.Array:
  """qg [B, T, Hkv, G, hd] float32 (scaled) against the cache's keys ->
  [B, Hkv, G, T, S] float32."""
  if _scores_kernel_runs(k_cache, token_major):
    batch, num_tree, num_kv_heads, group, head_dim = qg.shape
    rows = qg.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_tree, head_dim)
    scores = cpu_matmul.rows_matmul(rows, k_cache)
    return scores.reshape(batch, num_kv_heads, group, num_tree, -1)
  cache_axes = "bskd" if token_major else "bksd"
  return jnp.einsum(f"btkgd,{cache_axes}->bkgts", qg, k_cache.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "cache_layout"))
def tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float | None = None,
    cache_layout: str = common.TOKEN_MAJOR,
) -> jax.Array:
  """Attention over ``cache[:length] ++ tree`` with a tree mask.

  Args:
    q: [B, T, Hq, hd] queries of the tree tokens.
    k_cache, v_cache: [B, S, Hkv, hd] cached keys/values (``cache_layout``
      "bshd"), or [B, Hkv, S, hd] ("bhsd"); only the first ``lengths[b]``
      positions of row b count; past them keys may hold anything (even NaN),
      values anything finite (they get weight 0).
    lengths: [B] int, number of valid cache entries per row (0 allowed).
    k_tree, v_tree: [B, T, Hkv, hd] keys/values of the tree tokens.
    tree_mask: [B, T, T] bool, ``tree_mask[b, i, j]``: tree token i sees token j.
    scale: softmax scale, default ``hd ** -0.5``.
    cache_layout: ``common.TOKEN_MAJOR`` or ``common.HEAD_MAJOR``.

  Returns:
    [B, T, Hq, hd] in the dtype of ``q``. Softmax runs in float32. A query row
    that sees nothing (length 0 and an all-false mask row) returns zeros.
  """
  batch, num_tree, num_q_heads, head_dim = q.shape
  cache_size, num_kv_heads = common.cache_dims(k_cache.shape, cache_layout)
  group = num_q_heads // num_kv_heads
  scale = common.default_scale(head_dim, scale)
  token_major = cache_layout == common.TOKEN_MAJOR
  cache_axes = "bskd" if token_major else "bksd"
  # [B, T, Hkv, G, hd]: query heads grouped under the KV head they share.
  qg = q.reshape(batch, num_tree, num_kv_heads, group, head_dim)
  qg = qg.astype(jnp.float32) * scale
  # The cache and the tree are scored and weighted apart (one softmax over both
  # through a shared row max): concatenating them would copy the cache slice.
  s_cache = _cache_scores(qg, k_cache, token_major)
  s_tree = jnp.einsum("btkgd,bskd->bkgts", qg, k_tree.astype(jnp.float32))
  cache_valid = (jnp.arange(cache_size)[None, :] < lengths[:, None])[:, None, None, None]
  tree_valid = tree_mask[:, None, None]  # [B, 1, 1, T, T]
  s_cache = jnp.where(cache_valid, s_cache, common.MASK_VALUE)
  s_tree = jnp.where(tree_valid, s_tree, common.MASK_VALUE)
  row_max = jnp.maximum(s_cache.max(-1), s_tree.max(-1))[..., None]
  # The masks again after exp: a row that sees nothing has row_max = MASK_VALUE.
  p_cache = jnp.where(cache_valid, jnp.exp(s_cache - row_max), 0.0)
  p_tree = jnp.where(tree_valid, jnp.exp(s_tree - row_max), 0.0)
  denom = p_cache.sum(-1) + p_tree.sum(-1)  # [B, Hkv, G, T]
  # Values past the length get weight 0, which zeroes any finite value. Masking
  # them as well would copy the whole value cache every call (the largest cost
  # of a batched decode step), so non-finite values there are the caller's to
  # avoid; caches made here start at zero and only ever hold K/V of real tokens.
  out = (jnp.einsum(f"bkgts,{cache_axes}->bkgtd", p_cache, v_cache.astype(jnp.float32))
         + jnp.einsum("bkgts,bskd->bkgtd", p_tree, v_tree.astype(jnp.float32)))
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  out = out.transpose(0, 3, 1, 2, 4)  # [B, T, Hkv, G, hd]
  return out.reshape(batch, num_tree, num_q_heads, head_dim).astype(q.dtype)
