"""Pallas GPU (Triton backend) tree-attention kernel.

Grid ``(B, Hkv, row_blocks, splits)``; one program owns one KV head, one block of
``block_rows`` query rows and one split of the cache.

Layouts:
  * query rows: the ``G = Hq / Hkv`` query heads sharing a KV head are folded into
    the row axis, row ``r = t * G + g``, so a KV block is loaded once for the whole
    group. Rows are gathered straight from ``q [B, T, Hkv, G, hd]`` (a free
    reshape) and the output is scattered back the same way: no transposes.
  * cache ``[B, S, Hkv, hd]`` is read in place in blocks of ``block_kv`` rows by a
    loop whose trip count is ``cdiv(lengths[b], block_kv)``; rows past the length
    are masked off in the load, so padding is never read.
  * tree K/V ``[B, T, Hkv, hd]`` in blocks of ``block_tree`` keys; the ``[rows,
    keys]`` mask tile is gathered from ``tree_mask [B, T, T]`` (int8) with row
    ``r`` reading mask row ``r // G``. Blocks with no visible entry are skipped.
  * scores and softmax state are float32; Triton needs power-of-two tiles, so the
    head dim is padded (masked) to the next power of two >= 16.

Split-K (flash-decoding): when ``B * Hkv * row_blocks`` programs cannot fill the
GPU, the cache blocks of a row are shared out over ``splits`` programs that
write un-normalised partial results (acc, max, sum); a small XLA epilogue merges
them by log-sum-exp. Split 0 also handles the tree block.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.tree_attention import common

_MIN_TILE = 16  # Triton dot tiles need every dimension >= 16.
_DEFAULT_SM_COUNT = 132  # H100/H200; used when the device does not say.


def _sm_count() -> int:
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return _DEFAULT_SM_COUNT
  if device.platform != "gpu":
    return _DEFAULT_SM_COUNT
  return int(getattr(device, "core_count", _DEFAULT_SM_COUNT) or _DEFAULT_SM_COUNT)


def choose_num_splits(programs: int, cache_size: int, block_kv: int,
                      sm_count: int) -> int:
  """Cache splits so that about two programs run per SM; each split keeps >= 4 blocks."""
  max_splits = max(1, cache_size // (4 * block_kv))
  wanted = pl.cdiv(2 * sm_count, max(programs, 1))
  return int(max(1, min(wanted, max_splits, 32)))


def _kernel(
    lengths_ref,  # [] int32
    q_ref,  # [T, G, hd]
    k_cache_ref,  # [S, hd]
    v_cache_ref,  # [S, hd]
    k_tree_ref,  # [T, hd]
    v_tree_ref,  # [T, hd]
    mask_ref,  # [T, T] int8
    *out_refs,  # [T, G, hd] output, or (acc [rows, hd_p], max [rows], sum [rows]).
    scale: float,
    group: int,
    num_tree: int,
    head_dim: int,
    padded_head_dim: int,
    block_rows: int,
    block_kv: int,
    block_tree: int,
    num_splits: int,
    dtype: jnp.dtype,
    split_probs: bool,
):
  row_block, split = pl.program_id(2), pl.program_id(3)
  row = row_block * block_rows + lax.iota(jnp.int32, block_rows)
  token, head_in_group = row // group, row % group
  row_ok = token < num_tree
  dim = lax.iota(jnp.int32, padded_head_dim)
  dim_ok = dim < head_dim
  row_dim_ok = row_ok[:, None] & dim_ok[None, :]
  # All-array indices: a gather, so T x G rows need not be a power of two.
  q_index = (token[:, None], head_in_group[:, None], dim[None, :])
  q = plgpu.load(q_ref.at[q_index], mask=row_dim_ok, other=0).astype(dtype)
  precision = lax.Precision.HIGHEST  # f32: IEEE, not TF32; bf16/f16: native MMA.

  def update(carry, k, v, visible):
    """Online-softmax step: k, v [n, hd_p]; visible [rows, n] or [1, n] bool."""
    m_prev, l_prev, acc_prev = carry
    s = lax.dot_general(q, k.astype(dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32, precision=precision)
    s = jnp.where(visible, s * scale, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    pv = common.weighted_values(p, v, dtype, precision, split_probs)
    return m_next, l_next, alpha[:, None] * acc_prev + pv

  def load_kv(k_ref, v_ref, pos, pos_ok):
    index = (pos[:, None], dim[None, :])
    ok = pos_ok[:, None] & dim_ok[None, :]
    return (plgpu.load(k_ref.at[index], mask=ok, other=0),
            plgpu.load(v_ref.at[index], mask=ok, other=0))

  length = lengths_ref[()]

  def cache_body(block, carry):
    pos = block * block_kv + lax.iota(jnp.int32, block_kv)
    pos_ok = pos < length
    k, v = load_kv(k_cache_ref, v_cache_ref, pos, pos_ok)
    return update(carry, k, v, pos_ok[None, :])

  def tree_body(block, carry):
    col = block * block_tree + lax.iota(jnp.int32, block_tree)
    col_ok = col < num_tree
    mask = plgpu.load(mask_ref.at[token[:, None], col[None, :]],
                      mask=row_ok[:, None] & col_ok[None, :], other=0)
    visible = mask != 0

    def merge(carry):
      k, v = load_kv(k_tree_ref, v_tree_ref, col, col_ok)
      return update(carry, k, v, visible)

    return lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, merge, lambda c: c, carry)

  carry = (
      jnp.full((block_rows,), common.MASK_VALUE, jnp.float32),
      jnp.zeros((block_rows,), jnp.float32),
      jnp.zeros((block_rows, padded_head_dim), jnp.float32),
  )
  num_blocks = pl.cdiv(length, block_kv)
  blocks_per_split = pl.cdiv(num_blocks, num_splits)
  first = split * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, num_blocks)
  carry = lax.fori_loop(first, last, cache_body, carry)
  num_tree_iters = jnp.where(split == 0, pl.cdiv(num_tree, block_tree), 0)
  m, l, acc = lax.fori_loop(0, num_tree_iters, tree_body, carry)

  if num_splits == 1:
    (out_ref,) = out_refs
    # Rows that saw nothing have l == 0 and acc == 0: they return zeros.
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    plgpu.store(out_ref.at[q_index], out.astype(out_ref.dtype), mask=row_dim_ok)
  else:
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def tree_attention_pallas_gpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    out_dtype: jnp.dtype | None = None,
    split_probs: bool = True,
    block_rows: int | None = None,
    block_kv: int = 64,
    block_tree: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
  """Tree attention as a Pallas Triton kernel; semantics of ``tree_attention_reference``.

  Args:
    q: [B, T, Hq, hd]; k_cache, v_cache: [B, S, Hkv, hd]; lengths: [B] int;
      k_tree, v_tree: [B, T, Hkv, hd]; tree_mask: [B, T, T] bool.
    scale: softmax scale, default ``hd ** -0.5``.
    interpret: run under the Pallas interpreter on CPU.
    out_dtype: output dtype, default q's (tests read bf16 runs in float32).
    split_probs: 16-bit inputs: probabilities as hi + lo halves in the PV matmul
      (see ``common.weighted_values``); False is one matmul, ~3e-3 less exact.
    block_rows: query rows (T x G) per program, a power of two >= 16; default
      ``min(64, next_pow2(T * G))``.
    block_kv, block_tree: cache / tree keys per loop step, powers of two >= 16.
    num_splits: cache splits per row (split-K); default fills the GPU.
    num_warps, num_stages: Triton launch parameters.

  Returns:
    [B, T, Hq, hd] in ``out_dtype``.
  """
  dims = common.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
  batch, num_tree, group = dims.batch, dims.num_tree, dims.group
  num_kv_heads, head_dim = dims.num_kv_heads, dims.head_dim
  scale = common.default_scale(head_dim, scale)
  dtype = common.compute_dtype(q, k_cache, v_cache, k_tree, v_tree)
  out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if num_tree == 0:
    return jnp.zeros(q.shape, out_dtype)
  total_rows = num_tree * group
  if block_rows is None:
    block_rows = min(64, max(_MIN_TILE, common.next_power_of_2(total_rows)))
  block_tree = min(block_tree, max(_MIN_TILE, common.next_power_of_2(num_tree)))
  for name, size in (("block_rows", block_rows), ("block_kv", block_kv),
                     ("block_tree", block_tree)):
    if size < _MIN_TILE or size & (size - 1):
      raise ValueError(f"{name} must be a power of two >= 16, got {size}")
  padded_head_dim = max(_MIN_TILE, common.next_power_of_2(head_dim))
  num_row_blocks = pl.cdiv(total_rows, block_rows)
  cache_size = dims.cache_size
  if cache_size == 0:  # Nothing cached yet: one zero row keeps the shapes legal.
    k_cache = jnp.zeros((batch, 1, num_kv_heads, head_dim), k_cache.dtype)
    v_cache = jnp.zeros_like(k_cache)
  if num_splits is None:
    num_splits = choose_num_splits(batch * num_kv_heads * num_row_blocks, cache_size,
                                   block_kv, _sm_count())
  if num_warps is None:
    num_warps = 8 if block_rows * padded_head_dim >= 128 * 128 else 4
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, cache_size)
  q_rows = q.reshape(batch, num_tree, num_kv_heads, group, head_dim)
  mask = tree_mask.astype(jnp.int8)

  kernel = functools.partial(
      _kernel, scale=scale, group=group, num_tree=num_tree, head_dim=head_dim,
      padded_head_dim=padded_head_dim, block_rows=block_rows, block_kv=block_kv,
      block_tree=block_tree, num_splits=num_splits, dtype=dtype,
      split_probs=split_probs)
  rows_spec = pl.BlockSpec((None, num_tree, None, group, head_dim),
                           lambda b, h, r, s: (b, 0, h, 0, 0))
  cache_spec = pl.BlockSpec((None, k_cache.shape[1], None, head_dim),
                            lambda b, h, r, s: (b, 0, h, 0))
  tree_spec = pl.BlockSpec((None, num_tree, None, head_dim),
                           lambda b, h, r, s: (b, 0, h, 0))
  in_specs = [
      pl.BlockSpec((None,), lambda b, h, r, s: (b,)),
      rows_spec,
      cache_spec,
      cache_spec,
      tree_spec,
      tree_spec,
      pl.BlockSpec((None, num_tree, num_tree), lambda b, h, r, s: (b, 0, 0)),
  ]
  if num_splits == 1:
    out_shape = jax.ShapeDtypeStruct(q_rows.shape, out_dtype)
    out_specs = rows_spec
  else:
    padded_rows = num_row_blocks * block_rows
    part = (batch, num_kv_heads, num_splits, padded_rows)
    out_shape = (
        jax.ShapeDtypeStruct((*part, padded_head_dim), jnp.float32),
        jax.ShapeDtypeStruct(part, jnp.float32),
        jax.ShapeDtypeStruct(part, jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((None, None, None, block_rows, padded_head_dim),
                     lambda b, h, r, s: (b, h, s, r, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, h, r, s: (b, h, s, r)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, h, r, s: (b, h, s, r)),
    )
  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_row_blocks, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="tree_attention_gpu",
  )(lengths, q_rows, k_cache, v_cache, k_tree, v_tree, mask)

  if num_splits == 1:
    return out.reshape(q.shape)
  acc, m, l = out
  # Log-sum-exp merge of the splits: [B, Hkv, splits, rows(, hd)] -> [B, Hkv, rows, hd].
  m_max = jnp.max(m, axis=2, keepdims=True)
  weight = jnp.exp(m - m_max)
  l_total = jnp.sum(weight * l, axis=2)
  acc = jnp.sum(weight[..., None] * acc, axis=2)
  out = acc / jnp.where(l_total == 0.0, 1.0, l_total)[..., None]
  out = out[:, :, :total_rows, :head_dim].reshape(batch, num_kv_heads, num_tree, group,
                                                   head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(out_dtype)
