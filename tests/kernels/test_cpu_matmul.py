"""kernels.cpu_matmul: the AVX2 dense-layer kernel against float64, its M-invariance,
derivatives, shape errors, and the fallback when it cannot be built."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_matmul

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(),
                                  reason="needs x86-64 Linux with AVX2 + FMA and a C++ compiler")


def _case(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, k)))).astype(np.float32)
  w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, dtype)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  return jnp.asarray(x), w, x.astype(np.float64) @ w64.T, np.abs(x.astype(np.float64)) @ np.abs(w64).T


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (2, 37, 13), (7, 200, 45), (5, 37, 9),
                                   (65, 96, 264), (200, 1540, 70)])
def test_matches_float64_to_float32_accuracy(dtype, m, k, n):
  """Shapes cover every tail: rows past the 3-row tile, k % 8, n % 4 and n % 8,
  k % 8 where the first row tile stashes the widened bf16 rows (m > 3), and
  rows over several row blocks (85 rows each at k = 1540, the last one short)."""
  _check_float32_accurate(cpu_matmul.rows_matmul, cpu_matmul.rows_matmul_reference,
                          *_case(m, k, n, dtype))


def _check_float32_accurate(kernel, reference, x, w, exact, magnitude):
  got = np.asarray(jax.jit(kernel)(x, w))
  assert got.shape == exact.shape and got.dtype == np.float32
  # A float32 dot's own rounding over k terms of mixed magnitude (bound ~k * 2^-24).
  assert np.all(np.abs(got - exact) <= x.shape[1] * 2.0 ** -24 * magnitude + 1e-30)
  np.testing.assert_allclose(got, np.asarray(reference(x, w)),
                             rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k", [(40, 77), (200, 1540)])
def test_a_row_is_bitwise_the_same_whatever_the_call_holds(dtype, m, k):
  """The property that keeps speculative decoding lossless (also across the
  row blocks of a long call: 85 rows each at k = 1540)."""
  x, w, _, _ = _case(m, k, 70, dtype, seed=1)
  dot = jax.jit(cpu_matmul.rows_matmul)
  full = np.asarray(dot(x, w))
  for start, size in ((0, 1), (5, 1), (3, 2), (10, 4), (0, 9), (31, 9), (m - 7, 7)):
    np.testing.assert_array_equal(np.asarray(dot(x[start:start + size], w)),
                                  full[start:start + size])



def _panels_case(m, k, n, seed=0):
  x, w, exact, magnitude = _case(m, k, n, jnp.bfloat16, seed)
  return x, cpu_matmul.to_panels(w), exact, magnitude


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (1, 37, 72), (2, 37, 16), (3, 200, 40),
                                   (4, 96, 24), (7, 200, 56), (8, 576, 192),
                                   (13, 33, 8), (65, 96, 264)])
def test_panels_match_float64_to_float32_accuracy(m, k, n):
  """Shapes cover every tile (1-6 rows, 8 / 4 / 3 / 2 panels), the panels left
  over when the panel count is not a multiple of the tile's (n = 72, 40, 56, 264),
  several row tiles reading the widened stash (m > 6), and odd k."""
  _check_float32_accurate(cpu_matmul.panels_matmul, cpu_matmul.panels_matmul_reference,
                          *_panels_case(m, k, n))


@needs_kernel
@pytest.mark.parametrize("m,k", [(40, 77), (300, 576)])
def test_panels_give_a_row_the_same_bits_whatever_the_call_holds(m, k):
  x, w, _, _ = _panels_case(m, k, 72, seed=1)
  dot = jax.jit(cpu_matmul.panels_matmul)
  full = np.asarray(dot(x, w))
  for start, size in ((0, 1), (5, 1), (3, 2), (10, 4), (0, 7), (0, 9), (31, 9), (m - 7, 7)):
    np.testing.assert_array_equal(np.asarray(dot(x[start:start + size], w)),
                                  full[start:start + size])


def test_panels_round_trip_and_errors():
  w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
  panels = cpu_matmul.to_panels(w)
  assert panels.shape == (3, 5, 8) and panels[1, 2, 3] == w[8 + 3, 2]
  np.testing.assert_array_equal(cpu_matmul.from_panels(panels), w)
  with pytest.raises(ValueError, match="multiple of 8"):
    cpu_matmul.to_panels(np.zeros((12, 5)))
  with pytest.raises(ValueError, match="panels_matmul"):
    cpu_matmul.panels_matmul(jnp.ones((2, 5)), jnp.asarray(panels, jnp.float32))


@needs_kernel
def test_panels_derivatives_equal_the_reference_dots():
  x, w, _, _ = _panels_case(5, 24, 16, seed=2)
  loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
  got = jax.grad(loss(cpu_matmul.panels_matmul), argnums=0)(x, w)
  want = jax.grad(loss(cpu_matmul.panels_matmul_reference), argnums=0)(x, w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                             atol=1e-4 * float(jnp.abs(want).max()))

needs_amx = pytest.mark.skipif(not cpu_matmul.amx_active(),
                               reason="needs a CPU with AMX-BF16 and the tile state granted")


@needs_amx
@pytest.mark.parametrize("m", [1, 4, 5, 6, 10, 11, 33, 128])
@pytest.mark.parametrize("k,n", [(64, 48), (576, 200), (1536, 40)])
def test_amx_path_is_float32_accurate_and_m_invariant(m, k, n):
  """bf16 weights with k % 32 == 0 take the tile path: each row split into three
  bf16 parts, 5 rows per 16-column block (m = 5, 6, 10, 11 cross block and
  block-pair boundaries), n % 16 columns (n = 200, 40) on the AVX2 loop."""
  x, w, exact, magnitude = _case(m, k, n, jnp.bfloat16, seed=m)
  dot = jax.jit(cpu_matmul.rows_matmul)
  got = np.asarray(dot(x, w))
  assert np.all(np.abs(got - exact) <= k * 2.0 ** -24 * magnitude + 1e-30)
  for start in sorted({0, m // 2, m - 1}):
    np.testing.assert_array_equal(np.asarray(dot(x[start:start + 1], w)), got[start:start + 1])
  if m > 6:
    np.testing.assert_array_equal(np.asarray(dot(x[1:7], w)), got[1:7])


AMX_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512vl", "avx512_bf16", "amx_tile",
                       "amx_bf16"})


class _Library:
  """Stands in for the built kernel: ``DartRowsMatmulEnableAmx`` answers
  ``granted`` (1 or 0), or fails the test if ``granted`` is None."""

  def __init__(self, granted):
    self.granted = granted

  def DartRowsMatmulEnableAmx(self):  # pylint: disable=invalid-name
    assert self.granted is not None, "the AMX path was asked for while switched off"
    return self.granted


@pytest.mark.parametrize("switch,granted,want_on,logged", [
    ("0", None, False, cpu_matmul.AMX_ENV_SWITCH), ("1", 0, False, "refused"),
    ("1", 1, True, None)])
def test_amx_path_needs_the_switch_and_the_tile_state(monkeypatch, caplog, switch, granted,
                                                      want_on, logged):
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: AMX_FLAGS)
  monkeypatch.setenv(cpu_matmul.AMX_ENV_SWITCH, switch)
  monkeypatch.setattr(cpu_matmul, "_amx_state", [])
  with caplog.at_level(logging.INFO, logger=cpu_matmul.__name__):
    cpu_matmul._enable_amx(_Library(granted))  # pylint: disable=protected-access
  assert cpu_matmul._amx_state == ([True] if want_on else [])  # pylint: disable=protected-access
  if logged is None:
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
  else:
    assert logged in caplog.text


def test_no_amx_path_without_the_cpu_flags(monkeypatch):
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: AMX_FLAGS - {"avx512_bf16"})
  monkeypatch.setattr(cpu_matmul, "_amx_state", [])
  cpu_matmul._enable_amx(_Library(None))  # pylint: disable=protected-access
  assert not cpu_matmul._amx_state  # pylint: disable=protected-access
  assert not cpu_matmul.cpu_supports_amx_path()


@needs_kernel
def test_derivatives_equal_the_reference_dots():
  x, w, _, _ = _case(5, 24, 16, jnp.float32, seed=2)
  loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
  got = jax.grad(loss(cpu_matmul.rows_matmul), argnums=(0, 1))(x, w)
  want = jax.grad(loss(cpu_matmul.rows_matmul_reference), argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(r).max()))


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batched_items_equal_their_own_calls(dtype):
  """Leading dims are independent items (attention scores: batch x key/value
  heads, a few query rows against each item's own keys)."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 3, 7, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 3, 131, 64)), dtype)
  got = np.asarray(cpu_matmul.rows_matmul(x, w))
  assert got.shape == (2, 3, 7, 131)
  for b in range(2):
    for h in range(3):
      np.testing.assert_array_equal(got[b, h], np.asarray(cpu_matmul.rows_matmul(x[b, h], w[b, h])))
  want = np.einsum("bhmk,bhnk->bhmn", np.asarray(x, np.float64),
                   np.asarray(w.astype(jnp.float32), np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(np.asarray(cpu_matmul.rows_matmul_reference(x, w)), want,
                             rtol=1e-5, atol=1e-5 * np.abs(want).max())
  with pytest.raises(ValueError, match="equal leading dims"):
    cpu_matmul.rows_matmul(x, w[:1])


@needs_kernel
def test_mismatched_inner_dimensions_are_an_error():
  with pytest.raises(Exception, match="rows_matmul"):
    jax.block_until_ready(cpu_matmul.rows_matmul(jnp.ones((2, 8)), jnp.ones((16, 9))))


def test_a_failed_build_says_why(monkeypatch, tmp_path):
  compiler = cpu_matmul._compiler()  # pylint: disable=protected-access
  if compiler is None:
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("DART_JAX_CACHE", str(tmp_path))
  monkeypatch.setattr(cpu_matmul, "SOURCES", (tmp_path / "broken.cc",))
  (tmp_path / "broken.cc").write_text("this is not C++\n")
  with pytest.raises(RuntimeError, match="failed"):
    cpu_matmul.build(compiler)
  assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built is kept


def test_switched_off_by_the_environment(monkeypatch, caplog):
  monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "0")
  uncached = cpu_matmul.available.__wrapped__
  with caplog.at_level(logging.INFO, logger=cpu_matmul.__name__):
    assert uncached() is False
  assert cpu_matmul.ENV_SWITCH in caplog.text


def test_cpu_flags_decide_support(monkeypatch):
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
  assert cpu_matmul.cpu_supports_kernel() and not cpu_matmul.cpu_has_bf16_matrix_unit()
  assert not cpu_matmul.cpu_has_bf16_dot_instruction()
  # AVX512-BF16 without AMX (AMD Zen 4): XLA's bf16 dots measured slower than the
  # kernel at few rows, faster than widened float32 at many.
  monkeypatch.setattr(cpu_matmul, "cpu_flags",
                      lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
  assert cpu_matmul.cpu_supports_kernel() and not cpu_matmul.cpu_has_bf16_matrix_unit()
  assert cpu_matmul.cpu_has_bf16_dot_instruction()
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx", "amx_bf16"}))
  assert not cpu_matmul.cpu_supports_kernel() and cpu_matmul.cpu_has_bf16_matrix_unit()

  assert cpu_matmul.compile_flags() == ["-mavx2", "-mfma"]
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: AMX_FLAGS)
  assert cpu_matmul.compile_flags()[-3:] == ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]


def test_avx512_cpus_get_the_larger_tile_and_both_variants_build(monkeypatch, tmp_path):
  """The flags pick the tile (4 x 6 with AVX-512VL's 32 registers, else 3 x 4)
  and the AMX path; the variants this CPU does not run must still compile."""
  monkeypatch.setattr(cpu_matmul, "cpu_flags",
                      lambda: frozenset({"avx2", "fma", "avx512f", "avx512vl"}))
  assert cpu_matmul.compile_flags()[-2:] == ["-mavx512f", "-mavx512vl"]
  compiler = cpu_matmul._compiler()  # pylint: disable=protected-access
  if compiler is None:
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("DART_JAX_CACHE", str(tmp_path))
  wide = cpu_matmul.build(compiler)
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
  narrow = cpu_matmul.build(compiler)
  monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: AMX_FLAGS)
  tiles = cpu_matmul.build(compiler)  # the AMX path, built on any CPU
  assert len({wide, narrow, tiles}) == 3
  assert all(p.stat().st_size > 0 for p in (wide, narrow, tiles))


@needs_kernel
def test_bench_times_every_form(monkeypatch):
  from kernels.cpu_matmul import bench  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(bench, "SHAPES", {"tiny": (16, 24)})
  got = bench.table([1, 3], reps=1)["tiny"]
  assert set(got) == {1, 3}
  assert set(got[1]) == {"xla_f32_kn", "xla_f32_nk", "kernel_f32", "kernel_bf16",
                         "panels_bf16"}
  assert all(ms > 0 for row in got.values() for ms in row.values())


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 49152), (2, 3, 1000), (5, 7), (3, 1), (4, 17)])
def test_rows_argmax_is_the_first_index_of_the_maximum(shape):
  rng = np.random.default_rng(sum(shape))
  logits = rng.standard_normal(shape).astype(np.float32)
  flat = logits.reshape(-1, shape[-1])
  if shape[-1] > 3:
    flat[0, [shape[-1] - 1, 1, shape[-1] // 2]] = 7.0  # a tie: index 1 wins
    flat[-1, -1] = 9.0  # the maximum in the scalar tail
  got = np.asarray(jax.jit(cpu_matmul.rows_argmax)(jnp.asarray(logits)))
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
  assert got.dtype == np.int32 and got.shape == shape[:-1]


@needs_kernel
def test_rows_argmax_edge_rows_and_errors():
  logits = np.full((3, 20), -np.inf, np.float32)
  logits[1, 13] = 0.0
  logits[2, :] = np.nan
  logits[2, 9] = 1.0
  np.testing.assert_array_equal(np.asarray(cpu_matmul.rows_argmax(jnp.asarray(logits))),
                                [0, 13, 9])  # all -inf: the first; NaNs are skipped
  with pytest.raises(ValueError, match="float32"):
    cpu_matmul.rows_argmax(jnp.zeros((2, 4), jnp.bfloat16))


def _top_p_threshold_float64(logits: np.ndarray, top_p: float) -> np.ndarray:
  """The nucleus's smallest logit per row, masses in float64 (a full sort)."""
  ordered = -np.sort(-logits.astype(np.float64), axis=-1)
  probs = np.exp(ordered - ordered[..., :1])
  probs /= probs.sum(-1, keepdims=True)
  kept = np.cumsum(probs, -1) - probs < top_p
  return np.where(kept, ordered, np.inf).min(-1, keepdims=True).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("vocab,scale,top_p", [(49152, 3.0, 0.9), (49152, 8.0, 0.95),
                                               (3000, 1.0, 0.5), (100, 0.3, 0.99),
                                               (7, 2.0, 0.6), (1, 1.0, 0.5)])
def test_top_p_threshold_is_the_nucleus_smallest_logit(vocab, scale, top_p):
  rng = np.random.default_rng(vocab)
  logits = (rng.standard_normal((3, vocab)) * scale).astype(np.float32)
  if vocab > 10:
    logits[1, :5] = logits[1, 5]  # ties around the top
  got = np.asarray(jax.jit(lambda x: cpu_matmul.top_p_threshold(x, top_p))(
      jnp.asarray(logits)))
  np.testing.assert_array_equal(got, _top_p_threshold_float64(logits, top_p))
  assert got.shape == (3, 1)


@needs_kernel
def test_top_p_threshold_errors():
  with pytest.raises(ValueError, match="top_p"):
    cpu_matmul.top_p_threshold(jnp.zeros((2, 4)), 1.5)
  with pytest.raises(ValueError, match="float32"):
    cpu_matmul.top_p_threshold(jnp.zeros((2, 4), jnp.bfloat16), 0.5)


def _attention_case(batch, num_tree, num_q, num_kv, size, head_dim, cache_dtype, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q = jnp.asarray(normal(batch, num_tree, num_q, head_dim))
  k_cache = jnp.asarray(normal(batch, num_kv, size, head_dim) * 2, cache_dtype)
  v_cache = jnp.asarray(normal(batch, num_kv, size, head_dim), cache_dtype)
  k_tree = jnp.asarray(normal(batch, num_tree, num_kv, head_dim))
  v_tree = jnp.asarray(normal(batch, num_tree, num_kv, head_dim))
  mask = np.tril(rng.random((batch, num_tree, num_tree)) < 0.6) | np.eye(num_tree, dtype=bool)
  return q, k_cache, v_cache, k_tree, v_tree, jnp.asarray(mask)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,num_tree,num_q,num_kv,size,head_dim", [
    (1, 6, 9, 3, 256, 64), (3, 1, 4, 2, 40, 16), (2, 5, 8, 8, 33, 32), (2, 9, 4, 1, 17, 128),
    (1, 3, 2, 1, 8, 256)])
def test_tree_attention_matches_the_reference(cache_dtype, batch, num_tree, num_q, num_kv,
                                              size, head_dim):
  """Ragged lengths (0, full, in between), a query row that sees nothing (zeros),
  and NaN past every row's length (never read)."""
  from kernels.tree_attention import common, reference  # pylint: disable=import-outside-toplevel
  q, k_cache, v_cache, k_tree, v_tree, mask = _attention_case(
      batch, num_tree, num_q, num_kv, size, head_dim, cache_dtype)
  lengths = jnp.asarray(np.linspace(0, size, batch).round(), jnp.int32)
  if batch == 1:
    lengths = jnp.asarray([size - 3], jnp.int32)
  mask = mask.at[0, 0, 0].set(False)  # row 0 of batch 0: nothing but maybe the cache
  scale = head_dim ** -0.5
  want = np.asarray(reference.tree_attention_reference(
      q, k_cache, v_cache, lengths, k_tree, v_tree, mask, scale=scale,
      cache_layout=common.HEAD_MAJOR))
  past = np.arange(size)[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
  k_nan = jnp.where(past, jnp.nan, k_cache).astype(cache_dtype)
  v_nan = jnp.where(past, jnp.nan, v_cache).astype(cache_dtype)
  got = np.asarray(cpu_matmul.tree_attention(q, k_nan, v_nan, lengths, k_tree, v_tree, mask,
                                             scale))
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
  if int(lengths[0]) == 0:
    np.testing.assert_array_equal(got[0, 0], 0.0)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_tree_attention_of_a_path_token_equals_decoding_it_alone(cache_dtype):
  """Token t of a chain of tree tokens, its ancestors in the tree, gets the bits
  it gets with the ancestors written to the cache and itself the only new token
  (what one decoding step computes): verifying a tree is exactly decoding."""
  batch, num_tree, num_q, num_kv, size, head_dim = 2, 6, 6, 2, 64, 64
  q, k_cache, v_cache, k_tree, v_tree, _ = _attention_case(
      batch, num_tree, num_q, num_kv, size, head_dim, cache_dtype, seed=4)
  k_tree, v_tree = (a.astype(cache_dtype).astype(jnp.float32) for a in (k_tree, v_tree))
  lengths = jnp.asarray([23, 40], jnp.int32)
  chain = jnp.asarray(np.tril(np.ones((batch, num_tree, num_tree), bool)))
  scale = head_dim ** -0.5
  tree = np.asarray(cpu_matmul.tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree,
                                              chain, scale))
  for t in range(num_tree):
    k_step, v_step = k_cache, v_cache
    for j in range(t):  # the ancestors, written at the rows decoding would use
      rows = (jnp.arange(batch), slice(None), lengths + j)
      k_step = k_step.at[rows].set(k_tree[:, j].astype(cache_dtype))
      v_step = v_step.at[rows].set(v_tree[:, j].astype(cache_dtype))
    step = cpu_matmul.tree_attention(q[:, t:t + 1], k_step, v_step, lengths + t,
                                     k_tree[:, t:t + 1], v_tree[:, t:t + 1],
                                     jnp.ones((batch, 1, 1), bool), scale)
    np.testing.assert_array_equal(tree[:, t], np.asarray(step)[:, 0])


@needs_kernel
def test_tree_attention_derivatives_and_errors():
  from kernels.tree_attention import common, reference  # pylint: disable=import-outside-toplevel
  q, k_cache, v_cache, k_tree, v_tree, mask = _attention_case(1, 3, 4, 2, 16, 32, jnp.float32)
  lengths = jnp.asarray([9], jnp.int32)
  def loss(fn, q, k_tree):
    return jnp.sum(jnp.sin(fn(q, k_tree)))
  kernel = lambda q, kt: cpu_matmul.tree_attention(q, k_cache, v_cache, lengths, kt, v_tree,
                                                   mask, 0.2)
  ref = lambda q, kt: reference.tree_attention_reference(
      q, k_cache, v_cache, lengths, kt, v_tree, mask, scale=0.2,
      cache_layout=common.HEAD_MAJOR)
  for got, want in zip(jax.grad(lambda *a: loss(kernel, *a), (0, 1))(q, k_tree),
                       jax.grad(lambda *a: loss(ref, *a), (0, 1))(q, k_tree)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="hd in"):
    cpu_matmul.tree_attention(q[..., :24], k_cache[..., :24], v_cache[..., :24], lengths,
                              k_tree[..., :24], v_tree[..., :24], mask, 0.2)
  with pytest.raises(Exception, match="tree_attention"):
    jax.block_until_ready(cpu_matmul.tree_attention(q, k_cache, v_cache, lengths, k_tree[:, :2],
                                                    v_tree[:, :2], mask, 0.2))
