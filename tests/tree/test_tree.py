"""Tests of dart_jax.tree: TreeConfig, Tree conventions, hand-checked searches."""

import jax
import numpy as np
import pytest

from dart_jax.errors import ConfigError, InputError
from dart_jax.ngram import NGram
from dart_jax.tree import Tree, TreeConfig, dart_search
from dart_jax.tree.dart_search import exact_top_k, level_candidates
from dart_jax.tree.reference import reference_candidates, reference_search

search = jax.jit(dart_search, static_argnames=("config",))


def unit_weight(level: int) -> float:
  del level
  return 1.0


# ------------------------------------------------------------------ helpers
def tree_paths(tree: Tree) -> dict:
  """{token path (root excluded): score} of the valid nodes of `tree`."""
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  scores = np.asarray(tree.scores)
  out = {}
  for i in range(1, int(tree.num_nodes) + 1):
    path, j = [], i
    while j > 0:
      path.append(int(tokens[j]))
      j = int(parents[j])
    assert j == 0, "a valid node does not lead back to the root"
    out[tuple(path[::-1])] = float(scores[i])
  return out


def check_tree_properties(tree: Tree, num_levels: int):
  """Every structural promise of the Tree docstring, checked independently."""
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  depth, mask = np.asarray(tree.depth), np.asarray(tree.mask)
  paths, n = np.asarray(tree.paths), int(tree.num_nodes)
  size = tokens.shape[0]
  assert mask.shape == (size, size) and paths.shape == (size - 1,
                                                        num_levels + 1)
  assert parents[0] == -1 and depth[0] == 0
  valid = np.arange(size) <= n
  np.testing.assert_array_equal(np.asarray(tree.valid), valid)
  for i in range(1, n + 1):  # BFS order, parents first, depth = parent + 1.
    assert 0 <= parents[i] < i
    assert depth[i] == depth[parents[i]] + 1
    assert 1 <= depth[i] <= num_levels
  assert np.all(np.diff(depth[1:n + 1]) >= 0)
  for i in range(n + 1, size):  # Padding.
    assert tokens[i] == 0 and parents[i] == -1 and depth[i] == 0
    assert np.isneginf(tree.scores[i])
  # Prefix closure: every valid node's parent is valid (0..n).
  assert np.all(parents[1:n + 1] <= n)
  # Scores never increase along a path (all increments are <= 0).
  scores = np.asarray(tree.scores)
  assert np.all(scores[1:n + 1] <= scores[parents[1:n + 1]])
  # mask = ancestor-or-self, computed by walking parents.
  expected = np.eye(size, dtype=bool)
  for i in range(1, n + 1):
    j = parents[i]
    while j >= 0:
      expected[i, j] = True
      j = parents[j]
  np.testing.assert_array_equal(mask, expected)
  # Paths: one row per leaf, in node order, root -> leaf, -1 padded.
  has_child = set(parents[1:n + 1].tolist())
  leaves = [i for i in range(1, n + 1) if i not in has_child]
  assert int(tree.num_leaves) == len(leaves)
  for row, leaf in zip(paths, leaves):
    chain, j = [], leaf
    while j >= 0:
      chain.append(j)
      j = parents[j]
    chain = chain[::-1]
    np.testing.assert_array_equal(row[:len(chain)], chain)
    assert np.all(row[len(chain):] == -1)
  assert np.all(paths[len(leaves):] == -1)


# ------------------------------------------------------------------- config
def test_config_defaults_hashable_and_equal():
  a, b = TreeConfig(), TreeConfig()
  assert a == b and hash(a) == hash(b)
  assert (a.topk, a.beam_width, a.remain_total, a.ngram_weight) == (25, 20, 60,
                                                                    0.5)
  assert a.level_weight(0) == 1.0 and a.level_weight(3) == pytest.approx(
      4 ** -0.7)
  assert a.logit_weight(2) == pytest.approx(0.81)
  assert a.eos_id == "target" and a.search_eos_id is None and a.eps == 1e-10
  assert a.beam_sizes(8) == (1, 20, 20, 20, 20, 20, 20, 20)
  assert a.num_scored(8) == 25 + 7 * 20 * 25
  assert TreeConfig(topk=2, beam_width=3).beam_sizes(4) == (1, 2, 3, 3)
  assert TreeConfig(eos_id=2) != a
  leaves, _ = jax.tree_util.tree_flatten(a)
  assert leaves == []


@pytest.mark.parametrize("kwargs", [
    dict(topk=0), dict(beam_width=-1), dict(remain_total=0), dict(topk=2.5),
    dict(eos_id=-3), dict(eps=0.0), dict(level_weight=3.0)])
def test_config_rejects_bad_values(kwargs):
  with pytest.raises(ConfigError):
    TreeConfig(**kwargs)


# ------------------------------------------------------- hand-checked search
def test_two_level_search_by_hand():
  # Level 0: top-2 values [log 3, 0] -> p = [0.75, 0.25] (ids 0, 1).
  # Level 1: top-2 are id 2 (log 4) and id 0 (0; ties with id 1, lower id
  # wins) -> p = [0.8, 0.2]. Beam 1 keeps (0); keep 3 of the 4 nodes.
  logits = np.array([[np.log(3), 0.0, -9.0, -9.0],
                     [0.0, 0.0, np.log(4), -9.0]], np.float32)
  config = TreeConfig(topk=2, beam_width=1, remain_total=3,
                      level_weight=unit_weight, logit_weight=unit_weight)
  d2t = np.full(4, 10, np.int32)  # Draft id i -> target id i + 10.
  tree = search(logits, np.array([42], np.int32), None, config=config, d2t=d2t)
  np.testing.assert_array_equal(tree.tokens, [42, 10, 11, 12])
  np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1])
  np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2])
  np.testing.assert_allclose(
      tree.scores, [0, np.log(.75), np.log(.25), np.log(.75) + np.log(.8)],
      rtol=1e-6)
  np.testing.assert_array_equal(tree.paths, [[0, 2, -1], [0, 1, 3], [-1] * 3])
  assert int(tree.num_nodes) == 3 and int(tree.num_leaves) == 2


def test_ngram_term_uses_context_and_path_but_not_level_zero():
  # Order-2 model: after 5 comes 6 (3 times) or 7 (once); after 6 comes 7.
  ngram = NGram.build([[5, 6, 5, 6, 5, 6, 5, 7], [6, 7]], order=2)
  logits = np.zeros((2, 8), np.float32)
  logits[0, 6] = logits[0, 7] = 1.0  # Level 0: 6 and 7 tie.
  logits[1, 5] = logits[1, 7] = 1.0  # Level 1: 5 and 7 tie.
  config = TreeConfig(topk=2, beam_width=2, remain_total=6,
                      level_weight=unit_weight, logit_weight=unit_weight,
                      ngram_weight=1.0)
  context = np.array([5], np.int32)
  tree = search(logits, context, ngram.to_table(), config=config)
  paths = tree_paths(tree)
  log_half, eps = np.log(0.5), 1e-10
  # Level 0 has no n-gram term, although P(6|5) = 0.75 != P(7|5) = 0.25.
  assert paths[(6,)] == pytest.approx(log_half)
  assert paths[(7,)] == pytest.approx(log_half)
  # Level 1 conditions on the path: after 6 come 5 (3 times) and 7 (once),
  # so P(5|6) = 3/4 and P(7|6) = 1/4.
  assert paths[(6, 5)] == pytest.approx(2 * log_half + np.log(0.75))
  assert paths[(6, 7)] == pytest.approx(2 * log_half + np.log(0.25))
  # Nothing follows 7 in the data: log(0 + eps).
  assert paths[(7, 5)] == pytest.approx(2 * log_half + np.log(eps), rel=1e-5)
  ref = reference_search(logits, context, ngram, config)
  assert set(ref.paths) == set(paths)


def test_eos_children_ranked_last_in_beam():
  # Level 0: EOS (id 3) is by far the best candidate, but with beam 1 the
  # beam continues from the best non-EOS child (id 1).
  logits = np.array([[0.0, 2.0, -5.0, 9.0],
                     [1.0, 0.0, 3.0, -5.0]], np.float32)
  config = TreeConfig(topk=2, beam_width=1, remain_total=4, eos_id=3)
  tree = search(logits, np.array([0], np.int32), None, config=config)
  paths = tree_paths(tree)
  assert set(paths) == {(3,), (1,), (1, 2), (1, 0)}
  no_eos = search(logits, np.array([0], np.int32), None,
                  config=TreeConfig(topk=2, beam_width=1, remain_total=4))
  assert set(tree_paths(no_eos)) == {(3,), (1,), (3, 2), (3, 0)}


def test_eos_children_fill_the_beam_when_needed():
  # topk 1: the only child is EOS, so the beam must take it.
  logits = np.array([[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]], np.float32)
  config = TreeConfig(topk=1, beam_width=2, remain_total=5, eos_id=1)
  tree = search(logits, np.array([0], np.int32), None, config=config)
  assert set(tree_paths(tree)) == {(1,), (1, 0), (1, 0, 1)}
  check_tree_properties(tree, 3)


def test_prefix_closure_under_exact_ties():
  # topk 1: p = 1 at every level, so every score is exactly 0 and the final
  # cut must still keep a prefix (parents win ties).
  logits = np.random.default_rng(0).standard_normal((6, 16)).astype(np.float32)
  config = TreeConfig(topk=1, beam_width=1, remain_total=4)
  tree = search(logits, np.array([3], np.int32), None, config=config)
  assert np.all(np.asarray(tree.scores)[:5] == 0.0)
  np.testing.assert_array_equal(tree.depth, [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(tree.tokens[1:], np.argmax(logits[:4], axis=1))
  check_tree_properties(tree, 6)


def test_fewer_scored_nodes_than_budget():
  logits = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
  config = TreeConfig(topk=3, beam_width=1, remain_total=10)
  tree = search(logits, np.array([7], np.int32), None, config=config)
  assert int(tree.num_nodes) == 6 == config.num_tree_nodes(2)
  assert tree.tokens.shape == (11,) and tree.paths.shape == (10, 3)
  check_tree_properties(tree, 2)


def test_context_padding_and_short_context():
  rng = np.random.default_rng(2)
  ngram = NGram.build([rng.integers(0, 20, 500)], order=4)
  table = ngram.to_table()
  logits = rng.standard_normal((2, 20)).astype(np.float32)
  config = TreeConfig(topk=4, beam_width=3, remain_total=12)
  real = np.array([4, 9], np.int32)
  padded_a = np.array([0, 0, 0, 0, 0, 4, 9], np.int32)
  padded_b = np.array([1, 2, 3, 4, 5, 4, 9], np.int32)
  want = reference_search(logits, real, ngram, config)
  for context, length in ((real, None), (padded_a, 2), (padded_b, 2)):
    tree = search(logits, context, table, config=config,
                  context_len=None if length is None else np.int32(length))
    assert set(tree_paths(tree)) == set(want.paths)
    assert int(tree.tokens[0]) == 9
  # A context of one token (shorter than order-1 = 3) is allowed.
  tree = search(logits, np.array([9], np.int32), table, config=config)
  assert set(tree_paths(tree)) == set(
      reference_search(logits, [9], ngram, config).paths)


def test_vmap_matches_single_calls():
  rng = np.random.default_rng(3)
  ngram = NGram.build([rng.integers(0, 50, 800)], order=3)
  table = ngram.to_table()
  config = TreeConfig(topk=5, beam_width=4, remain_total=15, eos_id=2)
  batch, levels, vocab, width = 4, 3, 60, 6
  logits = rng.standard_normal((batch, levels, vocab)).astype(np.float32)
  contexts = rng.integers(0, 50, (batch, width)).astype(np.int32)
  lengths = np.array([6, 1, 3, 2], np.int32)
  d2t = np.zeros(vocab, np.int32)
  batched_search = jax.jit(
      jax.vmap(dart_search, in_axes=(0, 0, None, None, None, 0)),
      static_argnums=3)
  trees = batched_search(logits, contexts, table, config, d2t, lengths)
  for b in range(batch):
    single = search(logits[b], contexts[b], table, config=config, d2t=d2t,
                    context_len=lengths[b])
    for field in ("tokens", "parents", "depth", "mask", "num_nodes", "paths",
                  "num_leaves", "scores"):
      np.testing.assert_array_equal(getattr(trees, field)[b],
                                    getattr(single, field), err_msg=field)
  assert trees.valid.shape == (batch, 16)


# ----------------------------------------------------------- top-k stage
@pytest.mark.parametrize("vocab", [64, 1000, 49152, 50000])
def test_exact_top_k_matches_lax_top_k(vocab):
  rng = np.random.default_rng(vocab)
  x = rng.standard_normal((5, vocab)).astype(np.float32)
  x[1] = np.round(x[1])  # Heavy ties: lower index must win.
  x[2, :] = 0.0
  x[3, vocab // 2:] = -np.inf
  values, index = jax.jit(exact_top_k, static_argnums=1)(x, 25)
  want_values, want_index = jax.lax.top_k(x, 25)
  np.testing.assert_array_equal(index, want_index)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(index[2], np.arange(25))


def test_level_candidates_match_numpy():
  rng = np.random.default_rng(4)
  logits = np.round(rng.standard_normal((6, 3000)) * 2).astype(np.float32)
  d2t = np.sort(rng.choice(100000, 3000, replace=False)) - np.arange(3000)
  config = TreeConfig(topk=25)
  tokens, log_probs = jax.jit(level_candidates, static_argnums=1)(
      logits, config, d2t.astype(np.int32))
  want_tokens, want_log_probs = reference_candidates(logits, config, d2t)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(log_probs, want_log_probs, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
  logits = np.zeros((3, 10), np.float32)
  context = np.array([1, 2], np.int32)
  config = TreeConfig(topk=4, beam_width=2, remain_total=5)
  with pytest.raises(InputError, match="logits"):
    dart_search(logits[0], context, None, config)
  with pytest.raises(ConfigError, match="topk"):
    dart_search(logits, context, None, TreeConfig(topk=11))
  with pytest.raises(InputError, match="context"):
    dart_search(logits, context[None], None, config)
  with pytest.raises(InputError, match="context"):
    dart_search(logits, context.astype(np.float32), None, config)
  with pytest.raises(InputError, match="d2t"):
    dart_search(logits, context, None, config, d2t=np.zeros(9, np.int32))
  with pytest.raises(InputError, match="context_len"):
    dart_search(logits, context, None, config, context_len=np.ones(2))
  with pytest.raises(InputError, match="to_table"):
    dart_search(logits, context, NGram.build([[1, 2, 3]]), config)
  with pytest.raises(ConfigError):
    dart_search(logits, context, None, {"topk": 4})
