"""Shape checks and small helpers shared by the tree-attention implementations."""

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

# Finite stand-in for -inf: a row that sees nothing then gives exp(0) = 1 before
# the visibility mask zeroes it, instead of exp(-inf - -inf) = NaN.
MASK_VALUE = -1e30

# KV-cache layouts (keys and values alike).
# - TOKEN_MAJOR: [B, S, Hkv, hd]. The Pallas kernels read it (viewed as
#   lane-dense [B, S, Hkv * hd] rows).
# - HEAD_MAJOR: [B, Hkv, S, hd], the XLA path's (CPU): both attention dots then
#   batch over (B, Hkv) with the leading axes, where token-major buffers make
#   XLA:CPU emit one small dot per (b, kv head) or transpose the cache. Measured
#   on the 2-core CPU, SmolLM2-135M fast mode: a batched decode step (B=64, 512
#   cached positions) 462 ms token-major, 317 ms head-major (a variant with keys
#   transposed to [B, Hkv, hd, S] was slower in the model, 426 ms: slicing the
#   minor axis copies); one-sequence decode 29.2 -> 27.2 ms.
TOKEN_MAJOR = "bshd"
HEAD_MAJOR = "bhsd"
CACHE_LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)


def seq_axis(cache_layout: str) -> int:
  """The position axis of a cache buffer in ``cache_layout``."""
  if cache_layout == TOKEN_MAJOR:
    return 1
  if cache_layout == HEAD_MAJOR:
    return 2
  raise ValueError(f"unknown cache layout {cache_layout!r}; use one of {CACHE_LAYOUTS}")


def buffer_shape(cache_layout: str, batch: int, capacity: int, num_kv_heads: int,
                 head_dim: int) -> tuple[int, int, int, int]:
  """The shape of one layer's key or value buffer."""
  if seq_axis(cache_layout) == 1:
    return (batch, capacity, num_kv_heads, head_dim)
  return (batch, num_kv_heads, capacity, head_dim)


def cache_dims(cache_shape: tuple[int, ...], cache_layout: str) -> tuple[int, int]:
  """(S, Hkv) of a cache buffer in ``cache_layout``."""
  axis = seq_axis(cache_layout)
  return cache_shape[axis], cache_shape[3 - axis]


@dataclasses.dataclass(frozen=True)
class Dims:
  """Static sizes of one ``tree_attention`` call."""

  batch: int
  num_tree: int  # T, new tokens per row.
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  cache_size: int  # S, cache capacity.

  @property
  def group(self) -> int:
    """Query heads per KV head (GQA ratio)."""
    return self.num_q_heads // self.num_kv_heads


def check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask,
                 cache_layout: str = TOKEN_MAJOR) -> Dims:
  """Validates the ``tree_attention`` operands and returns their sizes."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hq, hd], got shape {q.shape}")
  batch, num_tree, num_q_heads, head_dim = q.shape
  if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
    named = "[B, S, Hkv, hd]" if cache_layout == TOKEN_MAJOR else "[B, Hkv, S, hd]"
    raise ValueError(
        f"k_cache and v_cache must both be {named} ({cache_layout!r}); got "
        f"{k_cache.shape} and {v_cache.shape}")
  cache_size, num_kv_heads = cache_dims(k_cache.shape, cache_layout)
  if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
    raise ValueError(
        f"cache shape {k_cache.shape} does not match q shape {q.shape} in batch or "
        "head_dim")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
  tree_shape = (batch, num_tree, num_kv_heads, head_dim)
  if k_tree.shape != tree_shape or v_tree.shape != tree_shape:
    raise ValueError(
        f"k_tree and v_tree must be [B, T, Hkv, hd] = {tree_shape}; got {k_tree.shape} "
        f"and {v_tree.shape}")
  if tree_mask.shape != (batch, num_tree, num_tree):
    raise ValueError(
        f"tree_mask must be [B, T, T] = {(batch, num_tree, num_tree)}; got "
        f"{tree_mask.shape}")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must be [B] = {(batch,)}; got {lengths.shape}")
  return Dims(batch, num_tree, num_q_heads, num_kv_heads, head_dim, cache_size)


def default_scale(head_dim: int, scale: float | None) -> float:
  """Softmax scale: ``hd ** -0.5`` unless given."""
  return head_dim**-0.5 if scale is None else float(scale)


def compute_dtype(*arrays: jax.Array) -> jnp.dtype:
  """The dtype both matmul operands are cast to inside a kernel (q and K/V may differ)."""
  return jnp.result_type(*(a.dtype for a in arrays))


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def next_power_of_2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


def weighted_values(p: jax.Array, v: jax.Array, dtype: jnp.dtype,
                    precision: lax.Precision, split_probs: bool) -> jax.Array:
  """``p @ v`` on the matrix unit: p [rows, n] float32, v [n, hd] -> [rows, hd] f32.

  With a 16-bit ``dtype`` the probabilities must be rounded to it for the MXU /
  tensor cores, an error of up to 2^-9 each (~3e-3 on outputs of size ~3). With
  ``split_probs`` they are sent as a hi + lo pair of 16-bit matrices, two matmuls
  that recover ~16 bits: cheap where attention is memory bound (decode, verify).
  """
  dims = (((1,), (0,)), ((), ()))
  v = v.astype(dtype)
  p_hi = p.astype(dtype)
  out = lax.dot_general(p_hi, v, dims, preferred_element_type=jnp.float32,
                        precision=precision)
  if split_probs and jnp.dtype(dtype).itemsize < 4:
    p_lo = (p - p_hi.astype(jnp.float32)).astype(dtype)
    out = out + lax.dot_general(p_lo, v, dims, preferred_element_type=jnp.float32,
                                precision=precision)
  return out
