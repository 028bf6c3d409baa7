"""Tree attention: jnp reference vs a naive loop, dispatch, and kernel layout helpers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.tree_attention import common
from kernels.tree_attention import ops
from kernels.tree_attention import pallas_gpu
from kernels.tree_attention import pallas_tpu
from kernels.tree_attention import tree_attention
from kernels.tree_attention import tree_attention_reference


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
  """parents [T] (parents[i] < i, -1 for a root) -> [T, T] bool: i sees itself and its ancestors."""
  num = len(parents)
  mask = np.zeros((num, num), bool)
  for i in range(num):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  return mask


def random_inputs(batch, num_tree, num_q_heads, num_kv_heads, head_dim, cache_size,
                  lengths, dtype=jnp.float32, *, seed=0, mask="tree"):
  """Random q / caches / tree K, V and per-row masks: random trees or causal."""
  rng = np.random.default_rng(seed)

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

  q = normal(batch, num_tree, num_q_heads, head_dim)
  k_cache = normal(batch, cache_size, num_kv_heads, head_dim)
  v_cache = normal(batch, cache_size, num_kv_heads, head_dim)
  k_tree = normal(batch, num_tree, num_kv_heads, head_dim)
  v_tree = normal(batch, num_tree, num_kv_heads, head_dim)
  if mask == "causal":
    masks = np.broadcast_to(np.tril(np.ones((num_tree, num_tree), bool)),
                            (batch, num_tree, num_tree))
  else:  # A random parent array per row: parent of node i is uniform in [-1, i).
    masks = np.stack([
        ancestor_mask(np.array([rng.integers(-1, i) if i else -1
                                for i in range(num_tree)]))
        for _ in range(batch)
    ])
  return (q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_tree, v_tree,
          jnp.asarray(masks))


def naive_tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask,
                         scale=None):
  """One query at a time in float64 numpy: the definition of the operation."""
  q, k_cache, v_cache, k_tree, v_tree = (
      np.asarray(x, np.float64) for x in (q, k_cache, v_cache, k_tree, v_tree))
  lengths, tree_mask = np.asarray(lengths), np.asarray(tree_mask)
  batch, num_tree, num_q_heads, head_dim = q.shape
  group = num_q_heads // k_cache.shape[2]
  scale = head_dim**-0.5 if scale is None else scale
  out = np.zeros_like(q)
  for b in range(batch):
    for t in range(num_tree):
      seen = np.flatnonzero(tree_mask[b, t])
      for h in range(num_q_heads):
        kv = h // group
        keys = np.concatenate([k_cache[b, :lengths[b], kv], k_tree[b, seen, kv]])
        values = np.concatenate([v_cache[b, :lengths[b], kv], v_tree[b, seen, kv]])
        if not len(keys):
          continue  # Sees nothing: zeros.
        scores = keys @ q[b, t, h] * scale
        probs = np.exp(scores - scores.max())
        out[b, t, h] = probs @ values / probs.sum()
  return out


@pytest.mark.parametrize(
    "batch,num_tree,num_q_heads,num_kv_heads,cache_size,lengths,mask,scale",
    [
        (2, 7, 4, 4, 20, [0, 13], "tree", None),  # MHA, length 0.
        (3, 5, 6, 2, 16, [16, 1, 9], "tree", 0.3),  # GQA 3, full cache, scale.
        (1, 9, 8, 1, 11, [4], "causal", None),  # GQA 8, causal (prefill).
        (2, 1, 2, 1, 8, [3, 8], "tree", None),  # Decode.
        # Batched decode.
        (16, 1, 6, 2, 12, [0, 12, 5] + [7] * 13, "tree", None),
        (16, 2, 4, 4, 10, list(range(10)) + [10] * 6, "tree", 0.5),
    ])
def test_reference_matches_naive_loop(batch, num_tree, num_q_heads, num_kv_heads,
                                      cache_size, lengths, mask, scale):
  args = random_inputs(batch, num_tree, num_q_heads, num_kv_heads, 16, cache_size,
                       lengths, seed=batch + num_tree, mask=mask)
  out = tree_attention_reference(*args, scale=scale)
  expected = naive_tree_attention(*args, scale=scale)
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
  # The head-major cache [B, Hkv, S, hd] holds the same entries: same result.
  head_major = (args[0], args[1].transpose(0, 2, 1, 3), args[2].transpose(0, 2, 1, 3),
                *args[3:])
  out = tree_attention(*head_major, impl="xla", scale=scale, cache_layout=common.HEAD_MAJOR)
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_layouts_per_impl_and_a_kernel_refuses_the_head_major_cache():
  assert ops.cache_layout_for("xla") == common.HEAD_MAJOR
  assert ops.cache_layout_for("pallas_tpu") == common.TOKEN_MAJOR
  assert ops.cache_layout_for("auto", "gpu") == common.TOKEN_MAJOR
  assert ops.cache_layout_for("auto", "cpu") == common.HEAD_MAJOR
  args = random_inputs(1, 3, 4, 2, 8, 6, [2])
  head_major = (args[0], args[1].transpose(0, 2, 1, 3), args[2].transpose(0, 2, 1, 3),
                *args[3:])
  with pytest.raises(ValueError, match="reads the token-major cache"):
    tree_attention(*head_major, impl="pallas_tpu", interpret=True,
                   cache_layout=common.HEAD_MAJOR)
  with pytest.raises(ValueError, match=r"\[B, Hkv, S, hd\]"):
    tree_attention(args[0], args[1], args[2][:, :5], *args[3:],
                   cache_layout=common.HEAD_MAJOR)
  with pytest.raises(ValueError, match="unknown cache layout"):
    tree_attention(*args, cache_layout="sbhd")


def test_reference_row_that_sees_nothing_is_zero_and_others_unchanged():
  q, k_cache, v_cache, _, k_tree, v_tree, mask = random_inputs(2, 4, 2, 1, 8, 6, [0, 0])
  lengths = jnp.array([0, 3], jnp.int32)
  mask = mask.at[:, 2, :].set(False)
  out = np.asarray(tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree,
                                            mask))
  np.testing.assert_array_equal(out[0, 2], 0.0)
  assert np.all(np.abs(out[1, 2]) > 0)  # Row 1 still sees its 3 cached tokens.
  expected = naive_tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, mask)
  np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch,num_tree", [(1, 3), (16, 1)])  # dots / multiply-reduce
def test_reference_ignores_cache_past_length(batch, num_tree):
  args = list(random_inputs(batch, num_tree, 2, 2, 8, 10, [4] * batch))
  out = tree_attention_reference(*args)
  # Garbage past the length must not leak in: any key (even NaN), any finite value.
  args[1] = args[1].at[:, 4:].set(jnp.nan)
  args[2] = args[2].at[:, 4:].set(3e38)
  np.testing.assert_array_equal(np.asarray(tree_attention_reference(*args)), out)


def test_reference_softmax_in_float32_for_bf16():
  args = random_inputs(1, 6, 4, 2, 32, 40, [33], jnp.bfloat16, seed=3)
  out = tree_attention_reference(*args)
  assert out.dtype == jnp.bfloat16
  expected = naive_tree_attention(*args)
  # Only the final rounding to bf16 (8 significant bits) separates the two.
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-3,
                             rtol=2.0**-8)


@pytest.mark.parametrize("backend,impl", [("tpu", "pallas_tpu"), ("gpu", "pallas_gpu"),
                                          ("cuda", "pallas_gpu"), ("cpu", "xla")])
def test_auto_picks_kernel_per_backend(backend, impl):
  assert ops.resolve_impl("auto", backend) == impl
  assert ops.resolve_impl("xla", backend) == "xla"


def test_entry_point_auto_on_cpu_is_the_reference_under_jit():
  args = random_inputs(2, 5, 4, 2, 16, 12, [7, 0])

  @jax.jit
  def run(lengths):  # lengths traced.
    return tree_attention(args[0], args[1], args[2], lengths, *args[4:])

  for lengths in ([7, 0], [12, 5]):
    lengths = jnp.asarray(lengths, jnp.int32)
    expected = tree_attention_reference(*args[:3], lengths, *args[4:])
    np.testing.assert_allclose(np.asarray(run(lengths)), np.asarray(expected), atol=1e-6)


def test_bad_impl_and_shapes_raise():
  args = random_inputs(1, 3, 4, 2, 8, 6, [2])
  with pytest.raises(ValueError, match="unknown tree_attention impl"):
    tree_attention(*args, impl="cuda")
  with pytest.raises(ValueError, match="multiple of KV heads"):
    common.check_shapes(args[0][:, :, :3], *args[1:])
  with pytest.raises(ValueError, match="tree_mask must be"):
    tree_attention(*args[:6], args[6][:, :2])
  with pytest.raises(ValueError, match="lengths must be"):
    tree_attention(*args[:3], args[3][None], *args[4:])


@pytest.mark.parametrize("num_kv_heads,head_dim,expected", [
    (8, 128, 1), (8, 64, 2), (4, 32, 4), (2, 32, 2), (3, 64, 3), (1, 80, 1)])
def test_tpu_heads_per_step_gives_lane_aligned_or_full_width(num_kv_heads, head_dim,
                                                             expected):
  assert pallas_tpu.heads_per_step(num_kv_heads, head_dim) == expected


@pytest.mark.parametrize("cache_size,block_kv", [(300, 128), (1030, 512), (512, 512),
                                                 (7, 512), (300, 512)])
def test_tpu_cache_blocks_tile_the_cache_with_aligned_windows(cache_size, block_kv):
  rows, num_blocks, tail_rows = pallas_tpu.cache_blocks(cache_size, block_kv)
  assert rows % 32 == 0 and rows <= max(block_kv, cache_size + 31)
  windows = [(i * rows, rows if i < num_blocks - 1 else tail_rows)
             for i in range(num_blocks)]
  covered = [r for start, n in windows for r in range(start, start + n)]
  assert covered == list(range(cache_size))  # Each row once, none past S.
  assert all(0 < n <= rows for _, n in windows)
  # A row of length L reads blocks 0 .. ceil(L / rows) - 1: never a block that
  # starts at or past L.
  for length in (0, 1, rows - 1, rows, rows + 1, cache_size):
    if length <= cache_size:
      read = windows[:math.ceil(length / rows)]
      assert all(start < length for start, _ in read)
      assert sum(n for _, n in read) >= length


def test_gpu_num_splits_fill_the_device_but_keep_blocks_per_split():
  # Decode, B=1, 8 KV heads, one row block: few programs, long cache -> split.
  assert pallas_gpu.choose_num_splits(8, 8192, 64, 132) == 32
  assert pallas_gpu.choose_num_splits(8, 1024, 64, 132) == 4  # >= 4 blocks each.
  assert pallas_gpu.choose_num_splits(512, 8192, 64, 132) == 1  # Already full.


def test_cpu_cache_scores_use_the_rows_kernel_and_do_not_depend_on_the_other_queries():
  """Head-major caches on CPU score through ``kernels.cpu_matmul`` (XLA's batched
  dot of a few rows was 9x slower); a query's scores must not depend on how many
  tree tokens share the call, or DART's verify would differ from decoding."""
  from kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
  from kernels.tree_attention import reference  # pylint: disable=import-outside-toplevel
  if not cpu_matmul.available():
    pytest.skip("the CPU kernel is not built here")
  rng = np.random.default_rng(5)
  qg = jnp.asarray(rng.standard_normal((2, 7, 3, 3, 64)), jnp.float32)  # [B, T, Hkv, G, hd]
  keys = jnp.asarray(rng.standard_normal((2, 3, 40, 64)), jnp.float32)  # [B, Hkv, S, hd]
  assert reference._scores_kernel_runs(keys, token_major=False)  # pylint: disable=protected-access
  assert not reference._scores_kernel_runs(keys, token_major=True)  # pylint: disable=protected-access
  scores = np.asarray(reference._cache_scores(qg, keys, False))  # pylint: disable=protected-access
  assert scores.shape == (2, 3, 3, 7, 40)
  alone = np.asarray(reference._cache_scores(qg[:, 3:4], keys, False))  # pylint: disable=protected-access
  np.testing.assert_array_equal(scores[:, :, :, 3:4], alone)
  want = np.einsum("btkgd,bksd->bkgts", np.asarray(qg, np.float64), np.asarray(keys, np.float64))
  np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not ops.cpu_kernel_runs(1, 64, jnp.float32, common.HEAD_MAJOR),
                    reason="needs the CPU attention kernel")
def test_xla_impl_on_cpu_takes_the_fused_kernel_only_where_it_applies():
  """Head-major caches with at most CPU_KERNEL_MAX_TREE new tokens and a head size
  it unrolls: one FFI call; prefill-sized calls, token-major caches and other head
  sizes: the XLA reference. Both give the reference's numbers."""
  def ffi_calls(num_tree, head_dim, layout):
    args = random_inputs(1, num_tree, 4, 2, head_dim, 80, [30])
    if layout == common.HEAD_MAJOR:
      args = (args[0], args[1].transpose(0, 2, 1, 3), args[2].transpose(0, 2, 1, 3),
              *args[3:])
    fn = jax.jit(lambda *a: tree_attention(*a, impl="xla", cache_layout=layout))
    out = fn(*args)
    want = tree_attention_reference(*args, cache_layout=layout)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=2e-6)
    return fn.lower(*args).as_text().count("dart_tree_attention")
  assert ffi_calls(6, 64, common.HEAD_MAJOR) == 1
  assert ffi_calls(ops.CPU_KERNEL_MAX_TREE + 1, 64, common.HEAD_MAJOR) == 0
  assert ffi_calls(6, 64, common.TOKEN_MAJOR) == 0
  assert ffi_calls(6, 24, common.HEAD_MAJOR) == 0


@pytest.mark.skipif(not ops.cpu_kernel_runs(1, 64, jnp.float32, common.HEAD_MAJOR),
                    reason="needs the CPU attention kernel")
def test_bench_times_the_cpu_kernel(capsys):
  from kernels.tree_attention import bench  # pylint: disable=import-outside-toplevel
  bench.main(["--reps", "2", "--dtype", "float32",
              "--shapes", "smollm2_decode,smollm2_verify_t6"])
  rows = [line.split() for line in capsys.readouterr().out.splitlines()
          if line.startswith("smollm2_")]
  assert [r[0] for r in rows] == ["smollm2_decode", "smollm2_verify_t6"]
  for row in rows:
    assert row[6] == bench.CPU_FUSED and float(row[8]) > 0 and row[9].endswith("x")
    assert float(row[10]) < 1e-5  # max |kernel - reference|
