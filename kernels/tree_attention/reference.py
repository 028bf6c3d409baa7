"""Pure-jnp tree attention: the ground truth for the Pallas kernels.

Each of the T new ("tree") tokens attends to the first ``lengths[b]`` entries of
the KV cache and to the tree tokens its ``tree_mask`` row allows. Prefill (causal
mask), decode (T=1) and tree verification are all this one operation.
"""

import functools

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@functools.partial(jax.jit, static_argnames=("scale",))
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
) -> jax.Array:
  """Attention over ``cache[:length] ++ tree`` with a tree mask.

  Args:
    q: [B, T, Hq, hd] queries of the tree tokens.
    k_cache, v_cache: [B, S, Hkv, hd] cached keys/values; only ``[:lengths[b]]``
      of row b is read.
    lengths: [B] int, number of valid cache entries per row (0 allowed).
    k_tree, v_tree: [B, T, Hkv, hd] keys/values of the tree tokens.
    tree_mask: [B, T, T] bool, ``tree_mask[b, i, j]``: tree token i sees token j.
    scale: softmax scale, default ``hd ** -0.5``.

  Returns:
    [B, T, Hq, hd] in the dtype of ``q``. Softmax runs in float32. A query row
    that sees nothing (length 0 and an all-false mask row) returns zeros.
  """
  batch, num_tree, num_q_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  group = num_q_heads // num_kv_heads
  scale = head_dim**-0.5 if scale is None else scale
  # [B, T, Hkv, G, hd]: query heads grouped under the KV head they share.
  qg = q.reshape(batch, num_tree, num_kv_heads, group, head_dim)
  qg = qg.astype(jnp.float32) * scale
  s_cache = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache.astype(jnp.float32))
  s_tree = jnp.einsum("btkgd,bskd->bkgts", qg, k_tree.astype(jnp.float32))
  cache_valid = jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None]  # [B, S]
  s_cache = jnp.where(cache_valid[:, None, None, None, :], s_cache, _NEG_INF)
  s_tree = jnp.where(tree_mask[:, None, None, :, :], s_tree, _NEG_INF)
  scores = jnp.concatenate([s_cache, s_tree], axis=-1)
  visible = jnp.concatenate(
      [
          jnp.broadcast_to(cache_valid[:, None, :], (batch, num_tree, k_cache.shape[1])),
          tree_mask,
      ],
      axis=-1,
  )  # [B, T, S+T]
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(visible[:, None, None], probs, 0.0)
  # Zero the values past the length too: 0 * garbage (NaN, inf) would leak.
  v_cache = jnp.where(cache_valid[:, :, None, None], v_cache, 0)
  values = jnp.concatenate([v_cache, v_tree], axis=1).astype(jnp.float32)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, values)
  return out.reshape(batch, num_tree, num_q_heads, head_dim).astype(q.dtype)
