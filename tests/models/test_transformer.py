"""Target model call modes: prefill, decode and tree verify agree with each other."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dart_jax.models import ModelConfig, Target, causal_mask
from dart_jax.models import layers
from dart_jax.models import target as target_lib
from dart_jax.models.transformer import KVCache
from kernels.tree_attention import HEAD_MAJOR, TOKEN_MAJOR
from kernels.tree_attention.ops import cpu_kernel_runs

CONFIGS = {
    "llama_gqa": ModelConfig(arch="llama", vocab_size=101, hidden_size=48,
                             intermediate_size=96, num_layers=3, num_heads=6,
                             num_kv_heads=2, head_dim=8, rope_theta=500.0),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=101, hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, qk_norm=True, tie_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def target(request):
  return Target.init(CONFIGS[request.param], seed=1)


def _full_logits(target, seqs, width=24):
  """Causal forward of each (unpadded) sequence from an empty cache -> last logits."""
  batch = len(seqs)
  tokens = np.zeros((batch, width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  lens = jnp.asarray([len(s) for s in seqs])
  col = jnp.arange(width)
  mask = (col[None, :] <= col[:, None])[None] & (col[None, None, :] < lens[:, None, None])
  pos = jnp.broadcast_to(col, (batch, width))
  out = target.forward(jnp.asarray(tokens), pos, target.new_cache(batch, 32), mask,
                       logit_rows=(lens - 1)[:, None])
  return np.asarray(out.logits[:, 0])


def test_prefill_then_decode_matches_full_forward(target):
  rng = np.random.RandomState(0)
  toks = jnp.asarray(rng.randint(0, 101, (2, 10)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  full = target.forward(toks, pos, target.new_cache(2, 32), causal_mask(2, 10)).logits
  out = target.forward(toks[:, :6], pos[:, :6], target.new_cache(2, 32),
                       causal_mask(2, 6), attend_len=8)
  np.testing.assert_allclose(out.logits, full[:, :6], atol=1e-5)
  cache = out.cache.replace(lengths=out.cache.lengths + 6)
  for i in range(6, 10):
    out = target.forward(toks[:, i:i + 1], pos[:, i:i + 1], cache,
                         jnp.ones((2, 1, 1), bool), attend_len=16)
    cache = out.cache.replace(lengths=out.cache.lengths + 1)
    np.testing.assert_allclose(out.logits[:, 0], full[:, i], atol=1e-5)


def _random_tree(rng, n):
  parents = np.full(n, -1)
  for i in range(1, n):
    parents[i] = rng.randint(0, i)
  depth = np.zeros(n, np.int32)
  mask = np.eye(n, dtype=bool)
  for i in range(1, n):
    depth[i] = depth[parents[i]] + 1
    mask[i] = mask[parents[i]]
    mask[i, i] = True
  return parents, depth, mask


def _path(parents, i):
  out = []
  while i >= 0:
    out.append(i)
    i = parents[i]
  return out[::-1]


def test_tree_verify_matches_sequential_paths(target):
  """Ragged batch: each node's logits equal a causal pass over prefix + its path."""
  rng = np.random.RandomState(3)
  batch, n = 2, 9
  prefix_lens = [5, 11]
  prefixes = [rng.randint(0, 101, l).tolist() for l in prefix_lens]
  cache = target.new_cache(batch, 32)
  width = 16
  tokens = np.zeros((batch, width), np.int32)
  for b, p in enumerate(prefixes):
    tokens[b, :len(p)] = p
  lens = jnp.asarray(prefix_lens)
  col = jnp.arange(width)
  mask = (col[None, :] <= col[:, None])[None] & (col[None, None, :] < lens[:, None, None])
  out = target.forward(jnp.asarray(tokens), jnp.broadcast_to(col, (batch, width)), cache,
                       mask, logit_rows=jnp.zeros((batch, 0), jnp.int32))
  cache = out.cache.replace(lengths=lens)
  trees = [_random_tree(rng, n) for _ in range(batch)]
  tree_tokens = rng.randint(0, 101, (batch, n)).astype(np.int32)
  positions = lens[:, None] + jnp.asarray(np.stack([t[1] for t in trees]))
  tree_mask = jnp.asarray(np.stack([t[2] for t in trees]))
  verify = target.forward(jnp.asarray(tree_tokens), positions, cache, tree_mask,
                          attend_len=16)
  seqs, where = [], []
  for b in range(batch):
    for i in range(n):
      seqs.append(prefixes[b] + [int(tree_tokens[b, j]) for j in _path(trees[b][0], i)])
      where.append((b, i))
  expected = _full_logits(target, seqs)
  got = np.stack([np.asarray(verify.logits[b, i]) for b, i in where])
  np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_compact_moves_accepted_entries(layout):
  k = jnp.arange(2 * 12, dtype=jnp.float32).reshape(2, 12, 1, 1) * jnp.ones((1, 1, 1, 8))
  if layout == HEAD_MAJOR:
    k = k.transpose(0, 2, 1, 3)
  cache = KVCache(k=(k,), v=(k + 100,), lengths=jnp.asarray([2, 4]), layout=layout)
  out = cache.compact(jnp.asarray([[0, 3, 5], [0, 1, 0]]), jnp.asarray([3, 2]))
  np.testing.assert_array_equal(out.lengths, [5, 6])
  if layout == HEAD_MAJOR:
    out = out.replace(k=(out.k[0].transpose(0, 2, 1, 3),),
                      v=(out.v[0].transpose(0, 2, 1, 3),))
  got = np.asarray(out.k[0][:, :, 0, 0])
  np.testing.assert_array_equal(got[0, 2:5], [2, 5, 7])  # rows 2+0, 2+3, 2+5
  np.testing.assert_array_equal(got[1, 4:6], [12 + 4, 12 + 5])
  np.testing.assert_array_equal(got[0, :2], [0, 1])  # committed rows untouched
  np.testing.assert_array_equal(np.asarray(out.v[0][0, 3, 0, 0]), 105)


def test_both_cache_layouts_give_the_same_decode(target):
  """Prefill, a tree-free decode step and a compact in either layout: the same
  logits and the same cache entries (the layout only moves axes)."""
  c = target.config
  tokens = jnp.asarray([[5, 6, 7, 8], [9, 3, 0, 0]], jnp.int32)
  results = {}
  for layout in (TOKEN_MAJOR, HEAD_MAJOR):
    cache = KVCache.create(c.num_layers, 2, 12, c.num_kv_heads, c.head_dim,
                           target.dtype, layout=layout)
    out = target.forward(tokens, jnp.arange(4)[None].repeat(2, 0), cache, causal_mask(2, 4))
    cache = out.cache.compact(jnp.asarray([[0, 1, 2, 3], [0, 1, 2, 3]]),
                              jnp.asarray([4, 2]))
    step = target.forward(jnp.asarray([[4], [4]]), cache.lengths[:, None], cache,
                          causal_mask(2, 1), attend_len=8)
    keys = step.cache.k[-1]
    results[layout] = (np.asarray(step.logits),
                       np.asarray(keys if layout == TOKEN_MAJOR else keys.transpose(0, 2, 1, 3)),
                       np.asarray(step.cache.lengths))
  for a, b in zip(results[TOKEN_MAJOR], results[HEAD_MAJOR]):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_taps_are_residual_stream_inputs(target):
  """Tap index 0 is the embedding; the last index is the pre-norm final hidden."""
  toks = jnp.asarray([[3, 4, 5]], jnp.int32)
  pos = jnp.arange(3)[None]
  n = target.config.num_layers
  out = target.forward(toks, pos, target.new_cache(1, 8), causal_mask(1, 3), taps=(0, n))
  h = target.config.hidden_size
  emb = np.asarray(target.params["embed_tokens"]["embedding"][...])[[3, 4, 5]]
  np.testing.assert_allclose(out.taps[0, :, :h], emb, atol=1e-6)
  final = target.module().logits(out.taps[:, :, h:])
  np.testing.assert_allclose(final, out.logits, atol=1e-4)


def test_cache_free_pass_matches_cached_prefill(target):
  toks = jnp.asarray(np.random.RandomState(5).randint(0, 101, (2, 7)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  cached = target.forward(toks, pos, target.new_cache(2, 8), causal_mask(2, 7), taps=(1,))
  free = target.module()(toks, pos, None, causal_mask(2, 7), taps=(1,))
  assert free.cache is None
  np.testing.assert_allclose(free.logits, cached.logits, atol=1e-5)
  np.testing.assert_allclose(free.taps, cached.taps, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas_tpu:interpret", "pallas_gpu:interpret"])
def test_tree_verify_through_kernels_matches_reference(impl):
  """The kernel path (Pallas interpret mode) gives the reference path's logits."""
  import dataclasses

  ref = Target.init(CONFIGS["llama_gqa"], seed=4)
  kern = dataclasses.replace(ref, attn_impl=impl)
  rng = np.random.RandomState(7)
  batch, n = 2, 7
  prefix = jnp.asarray(rng.randint(0, 101, (batch, 12)), jnp.int32)
  trees = [_random_tree(rng, n) for _ in range(batch)]
  tokens = jnp.asarray(rng.randint(0, 101, (batch, n)), jnp.int32)
  mask = jnp.asarray(np.stack([t[2] for t in trees]))
  results = []
  for target in (ref, kern):
    cache = target.new_cache(batch, 40)
    out = target.forward(prefix, jnp.broadcast_to(jnp.arange(12), (batch, 12)), cache,
                         causal_mask(batch, 12), logit_rows=jnp.zeros((batch, 0), jnp.int32))
    cache = out.cache.replace(lengths=jnp.asarray([12, 9]))  # ragged lengths
    depth = jnp.asarray(np.stack([t[1] for t in trees]))
    results.append(target.forward(tokens, cache.lengths[:, None] + depth, cache, mask,
                                  attend_len=16).logits)
  np.testing.assert_allclose(results[1], results[0], atol=1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_decode_step_does_not_copy_the_cache(batch):
  """A one-token step over a prefix of a donated cache updates it in place: no
  whole K/V buffer is copied (XLA:CPU copied every layer's buffers twice when
  a one-row write was fused into the attention's prefix slice; that happened
  with one sequence, the batch of 2 guards the batched path regeneration runs)."""
  t = Target.init(CONFIGS["llama_gqa"], seed=1)
  cache = t.new_cache(batch, 64).replace(lengths=jnp.full((batch,), 20, jnp.int32))
  compiled = target_lib._forward.lower(  # pylint: disable=protected-access
      t.graphdef, t.params, jnp.zeros((batch, 1), jnp.int32),
      jnp.full((batch, 1), 20, jnp.int32), cache, jnp.ones((batch, 1, 1), bool),
      attend_len=32, taps=(), logit_rows=None, attn_impl=t.attn_impl).compile()
  buffer = ",".join(map(str, cache.k[0].shape))
  copies = re.findall(rf"= f32\[{buffer}\]\{{[0-9,]+\}} copy\(", compiled.as_text())
  assert not copies, f"{len(copies)} whole-buffer copies of the cache"


def test_rope_tables_are_computed_once_per_pass():
  """The cos / sin of a pass's positions are evaluated once, not inside each
  layer's q and k rotation (XLA:CPU fused them into all 2L rotations), and are
  the tables of the positions' angles."""
  t = Target.init(CONFIGS["llama_gqa"], seed=1)
  cache = t.new_cache(1, 64).replace(lengths=jnp.full((1,), 20, jnp.int32))
  compiled = target_lib._forward.lower(  # pylint: disable=protected-access
      t.graphdef, t.params, jnp.zeros((1, 4), jnp.int32),
      jnp.arange(20, 24, dtype=jnp.int32)[None], cache, causal_mask(1, 4),
      attend_len=32, taps=(), logit_rows=None, attn_impl=t.attn_impl).compile()
  cosines = re.findall(r"= f32\[[0-9,]*\]\{[0-9,]*\} cosine\(", compiled.as_text())
  assert 1 <= len(cosines) <= 2, f"{len(cosines)} cosine ops for 3 layers"  # one per branch
  positions = np.array([[0, 5, 1000, 70000]], np.int32)
  inv_freq = np.asarray(t.module().inv_freq, np.float32)
  cos, sin = jax.jit(layers.rope_cos_sin, static_argnums=1)(
      jnp.asarray(positions), t.module().inv_freq)
  angles = positions[..., None].astype(np.float32) * inv_freq
  np.testing.assert_allclose(np.asarray(cos), np.cos(angles), atol=2e-6)
  np.testing.assert_allclose(np.asarray(sin), np.sin(angles), atol=2e-6)


@pytest.mark.skipif(not cpu_kernel_runs(4, 16, jnp.float32, HEAD_MAJOR),
                    reason="needs the CPU attention kernel")
def test_verifying_a_path_gives_decodings_bits():
  """Where the CPU kernels run (M-invariant dense layers, attention row by row in
  position order), a chain of tree tokens verified in one pass gets exactly the
  logits of decoding its tokens one by one: speculative decoding is lossless by
  construction there, not up to rounding."""
  t = Target.init(CONFIGS["qwen3"], seed=2)
  rng = np.random.RandomState(5)
  batch, prefix, n = 2, 7, 5
  tokens = jnp.asarray(rng.randint(0, 101, (batch, prefix + n)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(prefix + n), (batch, prefix + n))
  out = t.forward(tokens[:, :prefix], positions[:, :prefix], t.new_cache(batch, 32),
                  causal_mask(batch, prefix))
  start = out.cache.replace(lengths=jnp.full((batch,), prefix, jnp.int32))
  copy = lambda cache: jax.tree.map(jnp.copy, cache)  # forward donates its cache
  verify = t.forward(tokens[:, prefix:], positions[:, prefix:], copy(start),
                     causal_mask(batch, n), attend_len=16).logits
  cache = start
  for i in range(n):
    step = t.forward(tokens[:, prefix + i:prefix + i + 1], positions[:, prefix + i:prefix + i + 1],
                     cache, jnp.ones((batch, 1, 1), bool), attend_len=16)
    cache = step.cache.replace(lengths=step.cache.lengths + 1)
    np.testing.assert_array_equal(np.asarray(step.logits[:, 0]), np.asarray(verify[:, i]))
