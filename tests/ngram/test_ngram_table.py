"""The device n-gram table gives bit-identical answers to NGram.probability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dart_jax.errors import ConfigError
from dart_jax.ngram import NGram, NGramTable
from tests.ngram.test_ngram import hand_trie_bytes


def random_model(seed: int, order: int, vocab: int = 30) -> NGram:
  rng = np.random.default_rng(seed)
  sequences = [rng.zipf(1.3, size=rng.integers(1, 300)) % vocab
               for _ in range(20)]
  return NGram.build(sequences, order=order)


def random_queries(rng, batch, width, num_tokens, vocab):
  """Right-aligned windows, real lengths 0..width, candidate tokens."""
  windows = rng.integers(0, vocab, size=(batch, width)).astype(np.int32)
  lengths = rng.integers(0, width + 1, size=batch).astype(np.int32)
  tokens = rng.integers(0, vocab + 3, size=num_tokens).astype(np.int32)
  return windows, lengths, tokens


def assert_table_matches(ngram, table, windows, lengths, tokens):
  probs, matched = jax.jit(NGramTable.window_probability)(
      table, windows, lengths, tokens)
  probs, matched = np.asarray(probs), np.asarray(matched)
  for b in range(windows.shape[0]):
    context = windows[b, windows.shape[1] - lengths[b]:]
    want_p, want_m = ngram.probability(context, tokens)
    # Bit-identical float32, not just close.
    np.testing.assert_array_equal(probs[b].view(np.int32),
                                  want_p.view(np.int32))
    np.testing.assert_array_equal(matched[b], want_m)
  return probs, matched


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_table_bit_identical_random(order):
  rng = np.random.default_rng(order)
  ngram = random_model(order, order)
  table = ngram.to_table()
  windows, lengths, tokens = random_queries(rng, 64, max(order - 1, 1) + 1, 40,
                                            30)
  probs, matched = assert_table_matches(ngram, table, windows, lengths, tokens)
  if order > 1:  # The data is dense enough that many queries hit.
    assert (matched > 0).mean() > 0.3 and (matched == order - 1).any()


@pytest.mark.parametrize("threshold", [2, 4])
def test_table_bit_identical_reduced(threshold):
  rng = np.random.default_rng(threshold)
  ngram = random_model(10 + threshold, 3).reduce(threshold)
  table = ngram.to_table()
  windows, lengths, tokens = random_queries(rng, 64, 2, 40, 30)
  assert_table_matches(ngram, table, windows, lengths, tokens)


def test_table_from_unsorted_file_order_trie(tmp_path):
  path = tmp_path / "hand.trie"
  path.write_bytes(hand_trie_bytes())
  ngram = NGram.load_trie(path)
  table = ngram.to_table()
  windows = np.array([[7, 9], [9, 7], [5, 7], [0, 7], [5, 9], [1, 1]], np.int32)
  lengths = np.array([2, 2, 2, 1, 2, 2], np.int32)
  tokens = np.array([5, 7, 9, 3], np.int32)
  probs, matched = assert_table_matches(ngram, table, windows, lengths, tokens)
  np.testing.assert_array_equal(matched[2], [1, 0, 2, 0])  # Keeps the 2-match.


def test_step_next_nodes_are_suffix_nodes():
  rng = np.random.default_rng(0)
  ngram = random_model(3, 4)
  table = ngram.to_table()
  windows, lengths, tokens = random_queries(rng, 16, 3, 12, 30)
  suffix_nodes = jax.jit(NGramTable.suffix_nodes)
  nodes = suffix_nodes(table, windows, lengths)
  _, _, next_nodes = jax.jit(NGramTable.step)(table, nodes, tokens)
  for j, token in enumerate(tokens):
    appended = np.concatenate([windows[:, 1:], np.full((16, 1), token)], 1)
    expected = suffix_nodes(table, appended, np.minimum(lengths + 1, 3))
    np.testing.assert_array_equal(next_nodes[:, j], expected)
  # Node ids point at rows holding the right (token, count).
  for b in range(16):
    for m in range(1, 4):
      node = int(nodes[b, m - 1])
      gram = windows[b, 3 - m:]
      if m <= lengths[b] and ngram.node(gram) >= 0:
        assert int(table.keys[node, 1]) == gram[-1]
        assert int(table.counts[node]) == ngram.count(gram)
      else:
        assert node == -1


def test_table_memory_is_compact():
  ngram = random_model(7, 3, vocab=2000)
  table = ngram.to_table()
  assert table.num_ngrams == ngram.num_nodes - 1
  # 12 bytes per key + 4 per bucket at load 1, plus a little padding.
  assert table.bytes_per_ngram < 17
  assert ngram.reference_memory_bytes() / (ngram.num_nodes - 1) > 100


def test_table_is_a_pytree_and_vmaps():
  ngram = random_model(1, 3)
  table = ngram.to_table()
  leaves, treedef = jax.tree_util.tree_flatten(table)
  assert len(leaves) == 3
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert rebuilt.window == table.window
  rng = np.random.default_rng(1)
  contexts = rng.integers(0, 30, size=(5, 2)).astype(np.int32)
  tokens = rng.integers(0, 30, size=7).astype(np.int32)
  batched = jax.jit(jax.vmap(lambda t, c: t.probability(c, tokens),
                             in_axes=(None, 0)))(table, jnp.asarray(contexts))
  for b in range(5):
    want, _ = ngram.probability(contexts[b], tokens)
    np.testing.assert_array_equal(np.asarray(batched[0][b]), want)


def test_bad_load_factor():
  with pytest.raises(ConfigError):
    NGramTable.from_ngram(random_model(1, 2), load_factor=5.0)
