"""Pallas TPU (Mosaic) tree-attention kernel.

Grid ``(B, Hkv / heads_per_step, row_blocks, tree_blocks)``; one grid step owns
``heads_per_step`` KV heads and one block of query rows.

Layouts (all built outside the kernel from the public ``[B, T, H, hd]`` shapes):
  * query rows: the ``G = Hq / Hkv`` query heads that share a KV head are folded
    into the row axis, so every KV block is read once for the whole group. Rows of
    a row block are ordered ``(g, t)``: ``q_rows [B, Hkv, row_blocks * G * tb, hd]``.
  * cache: ``[B, S, Hkv * hd]`` (a free reshape), left in HBM (``pl.ANY``) and
    copied block by block with double-buffered manual DMA in a loop whose trip
    count is ``cdiv(lengths[b], block_kv)`` (lengths are scalar-prefetched to
    SMEM): cache padding past ``lengths[b]`` is never read.
  * tree: K/V ``[B, Tk, Hkv * hd]`` and the mask ``[B, Tq, Tk]`` int32 with the
    keys on the lane (last) axis, so the ``[rows, keys]`` score tile and its mask
    have the same lane-dense layout. The ``[tb, bt]`` mask block is tiled ``G``
    times along rows in-kernel (this is why rows are ``(g, t)`` ordered).
  * scores and the online softmax state (running max ``m``, sum ``l``,
    accumulator) are float32; ``m``/``l`` are kept lane-replicated ``[rows, 128]``.

The cache is processed at the first tree-block step, then each tree block is
merged in with the same log-sum-exp update; tree blocks with no visible entry
for the row block are skipped (``flags``, scalar-prefetched).
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.tree_attention import common

_LANES = 128
_SUBLANES = 8
_PACKED_ROWS = 32  # Sublane tile rows of the narrowest (8-bit) dtype.
# The per-(row block, tree block) skip flags live in SMEM; above this many the
# kernel visits every tree block instead.
_MAX_FLAGS = 4096


def heads_per_step(num_kv_heads: int, head_dim: int) -> int:
  """Fewest KV heads whose lane width ``heads * hd`` is a multiple of 128.

  Falls back to all KV heads (the full, always legal, lane width).
  """
  for heads in range(1, num_kv_heads + 1):
    if num_kv_heads % heads == 0 and heads * head_dim % _LANES == 0:
      return heads
  return num_kv_heads


def cache_blocks(cache_size: int, block_kv: int) -> tuple[int, int, int]:
  """Static cache tiling: (rows per block, blocks in S, rows in the last block).

  Block i is the DMA window ``[i * rows, i * rows + n)`` with n = rows, or the
  tail count for the last block when S is no multiple of ``rows``: windows start
  tile-aligned and never cross S. Small caches use one block of S rows
  (buffer rounded up to a packed-sublane tile).
  """
  rows = block_kv if cache_size > block_kv else common.round_up(cache_size, _PACKED_ROWS)
  num_blocks = pl.cdiv(cache_size, rows)
  return rows, num_blocks, cache_size - (num_blocks - 1) * rows


def _kernel(
    # Scalar prefetch (SMEM).
    lengths_ref,  # [B] int32
    flags_ref,  # [B * row_blocks * tree_blocks] int32
    # Inputs.
    q_ref,  # [heads, rows, hd]
    k_cache_hbm,  # [B, S, Hkv * hd] (HBM)
    v_cache_hbm,  # [B, S, Hkv * hd] (HBM)
    k_tree_ref,  # [bt, heads * hd]
    v_tree_ref,  # [bt, heads * hd]
    mask_ref,  # [tb, bt] int32
    # Output.
    out_ref,  # [heads, rows, hd]
    # Scratch.
    k_buf,  # [2, block_kv, heads * hd]
    v_buf,  # [2, block_kv, heads * hd]
    dma_sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    m_scr,  # [heads, rows, 128] f32
    l_scr,  # [heads, rows, 128] f32
    acc_scr,  # [heads, rows, hd] f32
    *,
    scale: float,
    group: int,
    heads: int,
    head_dim: int,
    block_kv: int,
    num_cache_blocks: int,
    tail_rows: int,
    num_row_blocks: int,
    num_tree_blocks: int,
    use_flags: bool,
    dtype: jnp.dtype,
    split_probs: bool,
    precision: lax.Precision,
):
  b, head_step = pl.program_id(0), pl.program_id(1)
  row_block, tree_block = pl.program_id(2), pl.program_id(3)
  width = heads * head_dim

  def update(h: int, k: jax.Array, v: jax.Array, visible: jax.Array | None):
    """Merges keys ``k`` / values ``v`` [n, hd] into the state of local head ``h``.

    visible: bool broadcastable to [rows, n], or None when all keys are visible.
    """
    q = q_ref[h].astype(dtype)
    s = lax.dot_general(q, k.astype(dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32, precision=precision)
    s = s * scale  # [rows, n]: keys on lanes.
    if visible is not None:
      s = jnp.where(visible, s, common.MASK_VALUE)
    m_prev = m_scr[h]  # [rows, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, :1])
    if visible is not None:
      p = jnp.where(visible, p, 0.0)
    l_scr[h] = alpha * l_scr[h] + jnp.sum(p, axis=-1, keepdims=True)
    m_scr[h] = m_next
    pv = common.weighted_values(p, v, dtype, precision, split_probs)
    acc_scr[h] = alpha[:, :1] * acc_scr[h] + pv

  @pl.when(tree_block == 0)
  def _cache_phase():
    m_scr[...] = jnp.full(m_scr.shape, common.MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    length = lengths_ref[b]
    num_blocks = pl.cdiv(length, block_kv)
    cols = pl.ds(pl.multiple_of(head_step * width, width), width)

    def dma(block, slot, wait: bool):
      """Starts (or waits for) the K and V copies of cache block ``block``."""

      def run(num_rows: int):
        rows = pl.ds(pl.multiple_of(block * block_kv, _PACKED_ROWS), num_rows)
        for i, (hbm, buf) in enumerate(((k_cache_hbm, k_buf), (v_cache_hbm, v_buf))):
          copy = pltpu.make_async_copy(hbm.at[b, rows, cols],
                                       buf.at[slot, pl.ds(0, num_rows)],
                                       dma_sems.at[i, slot])
          if wait:
            copy.wait()
          else:
            copy.start()

      if tail_rows == block_kv:
        run(block_kv)
      else:  # The last block of S is shorter; the buffer rows past it are stale.
        pl.when(block < num_cache_blocks - 1)(lambda: run(block_kv))
        pl.when(block == num_cache_blocks - 1)(lambda: run(tail_rows))

    @pl.when(num_blocks > 0)
    def _prefetch_first():
      dma(0, 0, wait=False)

    def body(block, carry):
      slot = lax.rem(block, 2)
      dma(block, slot, wait=True)

      @pl.when(block + 1 < num_blocks)
      def _prefetch_next():
        dma(block + 1, 1 - slot, wait=False)

      block_lo = block * block_kv
      is_full = block_lo + block_kv <= length

      @pl.when(is_full)
      def _full_block():
        for h in range(heads):
          lanes = slice(h * head_dim, (h + 1) * head_dim)
          update(h, k_buf[slot, :, lanes], v_buf[slot, :, lanes], None)

      @pl.when(jnp.logical_not(is_full))
      def _partial_block():
        key_ok = block_lo + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1) < length
        row_pos = block_lo + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        row_ok = row_pos < length
        for h in range(heads):
          lanes = slice(h * head_dim, (h + 1) * head_dim)
          # Zero values past the length: 0 * stale data (NaN) would poison acc.
          v = jnp.where(row_ok, v_buf[slot, :, lanes], 0)
          update(h, k_buf[slot, :, lanes], v, key_ok)

      return carry

    lax.fori_loop(0, num_blocks, body, 0)

  def _tree_phase():
    mask = mask_ref[...]  # [tb, bt]
    if group > 1:
      mask = jnp.concatenate([mask] * group, axis=0)  # rows are (g, t) ordered.
    visible = mask != 0
    for h in range(heads):
      lanes = slice(h * head_dim, (h + 1) * head_dim)
      update(h, k_tree_ref[:, lanes], v_tree_ref[:, lanes], visible)

  if use_flags:
    flag = flags_ref[(b * num_row_blocks + row_block) * num_tree_blocks + tree_block]
    pl.when(flag != 0)(_tree_phase)
  else:
    _tree_phase()

  @pl.when(tree_block == num_tree_blocks - 1)
  def _finalize():
    for h in range(heads):
      l = l_scr[h][:, :1]
      # Rows that saw nothing have l == 0 and acc == 0: they return zeros.
      out = acc_scr[h] / jnp.where(l == 0.0, 1.0, l)
      out_ref[h] = out.astype(out_ref.dtype)


def tree_attention_pallas_tpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    out_dtype: jnp.dtype | None = None,
    split_probs: bool = True,
    block_kv: int = 512,
    block_rows: int = 256,
    block_tree: int = 512,
) -> jax.Array:
  """Tree attention as a Pallas TPU kernel; semantics of ``tree_attention_reference``.

  Args:
    q: [B, T, Hq, hd]; k_cache, v_cache: [B, S, Hkv, hd]; lengths: [B] int;
      k_tree, v_tree: [B, T, Hkv, hd]; tree_mask: [B, T, T] bool.
    scale: softmax scale, default ``hd ** -0.5``.
    interpret: run under the TPU interpreter on CPU: True for default
      ``pltpu.InterpretParams()``, or pass one (e.g. with ``detect_races=True``).
    out_dtype: output dtype, default q's (tests read bf16 runs in float32).
    split_probs: 16-bit inputs: probabilities as hi + lo halves in the PV matmul
      (see ``common.weighted_values``); False is one matmul, ~3e-3 less exact.
    block_kv: cache rows per DMA block (a multiple of 128; caches with S <= block_kv
      use one block of S rows).
    block_rows: target query rows (tree tokens x group) per grid step.
    block_tree: tree keys per grid step (a multiple of 128).

  Returns:
    [B, T, Hq, hd] in ``out_dtype``.
  """
  dims = common.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
  if block_kv % _LANES or block_tree % _LANES:
    raise ValueError(f"block_kv ({block_kv}) and block_tree ({block_tree}) must be "
                     "multiples of 128")
  batch, num_tree, group = dims.batch, dims.num_tree, dims.group
  num_kv_heads, head_dim = dims.num_kv_heads, dims.head_dim
  scale = common.default_scale(head_dim, scale)
  dtype = common.compute_dtype(q, k_cache, v_cache, k_tree, v_tree)
  out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if num_tree == 0:
    return jnp.zeros(q.shape, out_dtype)
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT

  cache_size = dims.cache_size
  if cache_size == 0:  # Nothing cached yet: a tiny zero cache keeps shapes legal.
    k_cache = jnp.zeros((batch, _SUBLANES, num_kv_heads, head_dim), k_cache.dtype)
    v_cache = jnp.zeros_like(k_cache)
    cache_size = _SUBLANES
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, dims.cache_size)
  block_kv, num_cache_blocks, tail_rows = cache_blocks(cache_size, block_kv)

  heads = heads_per_step(num_kv_heads, head_dim)
  width = heads * head_dim

  # Query rows: tb tokens x G heads per row block.
  tokens_per_block = max(_SUBLANES, block_rows // group // _SUBLANES * _SUBLANES)
  tokens_per_block = min(tokens_per_block, common.round_up(num_tree, _SUBLANES))
  num_row_blocks = pl.cdiv(num_tree, tokens_per_block)
  padded_q = num_row_blocks * tokens_per_block
  rows = group * tokens_per_block
  # Tree keys, on lanes.
  tree_block = min(block_tree, common.round_up(num_tree, _LANES))
  num_tree_blocks = pl.cdiv(num_tree, tree_block)
  padded_k = num_tree_blocks * tree_block

  q_rows = q.reshape(batch, num_tree, num_kv_heads, group, head_dim)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, padded_q - num_tree), (0, 0), (0, 0), (0, 0)))
  q_rows = q_rows.reshape(batch, num_row_blocks, tokens_per_block, num_kv_heads, group,
                          head_dim)
  q_rows = q_rows.transpose(0, 3, 1, 4, 2, 5).reshape(
      batch, num_kv_heads, num_row_blocks * rows, head_dim)
  k_cache = k_cache.reshape(batch, cache_size, num_kv_heads * head_dim)
  v_cache = v_cache.reshape(batch, cache_size, num_kv_heads * head_dim)
  tree_pad = ((0, 0), (0, padded_k - num_tree), (0, 0), (0, 0))
  k_tree = jnp.pad(k_tree, tree_pad).reshape(batch, padded_k, num_kv_heads * head_dim)
  v_tree = jnp.pad(v_tree, tree_pad).reshape(batch, padded_k, num_kv_heads * head_dim)
  mask = jnp.pad(tree_mask.astype(jnp.int32),
                 ((0, 0), (0, padded_q - num_tree), (0, padded_k - num_tree)))
  use_flags = batch * num_row_blocks * num_tree_blocks <= _MAX_FLAGS
  if use_flags:
    flags = mask.reshape(batch, num_row_blocks, tokens_per_block, num_tree_blocks,
                         tree_block).max(axis=(2, 4)).reshape(-1)
  else:
    flags = jnp.ones((1,), jnp.int32)

  kernel = functools.partial(
      _kernel, scale=scale, group=group, heads=heads, head_dim=head_dim,
      block_kv=block_kv, num_cache_blocks=num_cache_blocks, tail_rows=tail_rows,
      num_row_blocks=num_row_blocks,
      num_tree_blocks=num_tree_blocks, use_flags=use_flags, dtype=dtype,
      precision=precision, split_probs=split_probs)
  # Index maps get the grid indices, then the scalar-prefetch refs.
  rows_spec = pl.BlockSpec((None, heads, rows, head_dim),
                           lambda b, hs, rb, tj, *_: (b, hs, rb, 0))
  tree_spec = pl.BlockSpec((None, tree_block, width),
                           lambda b, hs, rb, tj, *_: (b, tj, hs))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, num_kv_heads // heads, num_row_blocks, num_tree_blocks),
      in_specs=[
          rows_spec,
          pl.BlockSpec(memory_space=pl.ANY),
          pl.BlockSpec(memory_space=pl.ANY),
          tree_spec,
          tree_spec,
          pl.BlockSpec((None, tokens_per_block, tree_block),
                       lambda b, hs, rb, tj, *_: (b, rb, tj)),
      ],
      out_specs=rows_spec,
      scratch_shapes=[
          pltpu.VMEM((2, block_kv, width), k_cache.dtype),
          pltpu.VMEM((2, block_kv, width), v_cache.dtype),
          pltpu.SemaphoreType.DMA((2, 2)),
          pltpu.VMEM((heads, rows, _LANES), jnp.float32),
          pltpu.VMEM((heads, rows, _LANES), jnp.float32),
          pltpu.VMEM((heads, rows, head_dim), jnp.float32),
      ],
  )
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(q_rows.shape, out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret is True else interpret,
      name="tree_attention_tpu",
  )(lengths, flags, q_rows, k_cache, v_cache, k_tree, v_tree, mask)

  out = out.reshape(batch, num_kv_heads, num_row_blocks, group, tokens_per_block,
                    head_dim)
  out = out.transpose(0, 2, 4, 1, 3, 5).reshape(batch, padded_q, dims.num_q_heads,
                                                 head_dim)
  return out[:, :num_tree]
