"""Acceptance on its own (``dart_jax.decode.verify``): the accepted path against an
independent walk, the emitted tokens' distribution, and the history / cache update."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dart_jax.decode.verify import accept_and_compact, accept_tree
from dart_jax.models.transformer import KVCache
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import Tree

VOCAB = 7
GREEDY = SamplingConfig()


def _random_tree(rng, size: int, num_nodes: int, vocab: int = VOCAB):
  """A tree in the ``Tree`` conventions: parents[i] < i, distinct sibling tokens,
  padding (index > num_nodes) with parent -1."""
  tokens = np.zeros(size, np.int32)
  parents = np.full(size, -1, np.int32)
  depth = np.zeros(size, np.int32)
  for i in range(1, num_nodes + 1):
    for _ in range(100):
      parent = int(rng.integers(0, i))
      used = {int(tokens[j]) for j in range(1, i) if parents[j] == parent}
      free = [t for t in range(vocab) if t not in used]
      if free:
        break
    parents[i], tokens[i] = parent, int(rng.choice(free))
    depth[i] = depth[parent] + 1
  tokens[0] = int(rng.integers(vocab))
  return tokens, parents, depth


def _walk(tokens, parents, num_nodes, drawn):
  """The sample-and-match walk, node by node: -> (path, emitted tokens)."""
  path, node = [0], 0
  while True:
    child = [i for i in range(1, num_nodes + 1)
             if parents[i] == node and tokens[i] == drawn[node]]
    if not child:
      return path, [int(tokens[i]) for i in path[1:]] + [int(drawn[node])]
    node = child[0]
    path.append(node)


def test_greedy_acceptance_equals_an_independent_walk():
  rng = np.random.default_rng(0)
  batch, size = 64, 12
  trees = [_random_tree(rng, size, int(rng.integers(0, size))) for _ in range(batch)]
  num_nodes = np.array([int((t[1] >= 0).sum()) for t in trees], np.int32)
  tokens, parents, depth = (np.stack([t[k] for t in trees]) for k in range(3))
  # Peaked logits whose argmax follows a tree branch often, so long paths occur.
  logits = rng.normal(size=(batch, size, VOCAB)).astype(np.float32)
  for b in range(batch):
    for i in range(size):
      children = [j for j in range(1, num_nodes[b] + 1) if parents[b, j] == i]
      if children and rng.random() < 0.7:
        logits[b, i, tokens[b, rng.choice(children)]] += 5.0
  max_depth = int(depth.max())
  acc = accept_tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(depth),
                    jnp.asarray(num_nodes), jnp.asarray(logits), jax.random.PRNGKey(0),
                    GREEDY, max_depth=max_depth)
  lengths = []
  for b in range(batch):
    path, emitted = _walk(tokens[b], parents[b], num_nodes[b], logits[b].argmax(-1))
    n = len(emitted)
    lengths.append(n)
    assert int(acc.num_new[b]) == n
    assert np.asarray(acc.path[b, :n]).tolist() == path
    assert np.asarray(acc.new_tokens[b, :n]).tolist() == emitted
    assert not np.asarray(acc.new_tokens[b, n:]).any()
  assert max(lengths) >= 3 and min(lengths) == 1  # the trees exercised both ends


def test_padding_nodes_are_never_accepted():
  tokens = jnp.asarray([[0, 3, 4]], jnp.int32)
  parents = jnp.asarray([[-1, 0, 1]], jnp.int32)
  depth = jnp.asarray([[0, 1, 2]], jnp.int32)
  logits = jnp.zeros((1, 3, VOCAB)).at[0, 0, 3].set(9.0).at[0, 1, 4].set(9.0)
  full = accept_tree(tokens, parents, depth, jnp.asarray([2]), logits,
                     jax.random.PRNGKey(0), GREEDY, max_depth=2)
  cut = accept_tree(tokens, parents, depth, jnp.asarray([1]), logits,
                    jax.random.PRNGKey(0), GREEDY, max_depth=2)
  assert np.asarray(full.new_tokens[0]).tolist() == [3, 4, 0]  # then argmax of zeros
  assert int(cut.num_new[0]) == 2 and np.asarray(cut.new_tokens[0, :2]).tolist() == [3, 4]


def _p(counts, probs):
  probs = np.asarray(probs, np.float64)
  expected = probs / probs.sum() * counts.sum()
  return stats.chisquare(counts.astype(np.float64), expected).pvalue


def test_sampled_tokens_follow_the_target_along_the_tree():
  """The first emitted token ~ p(root); given that it is a child c, the second ~
  p(c): each emitted token is a draw of the target given its prefix."""
  tokens = np.asarray([0, 2, 5, 1], np.int32)   # root; children 2, 5; grandchild 1 under 2
  parents = np.asarray([-1, 0, 0, 1], np.int32)
  depth = np.asarray([0, 1, 1, 2], np.int32)
  logits = np.random.default_rng(3).normal(size=(4, VOCAB)).astype(np.float32)
  logits[0, 2] += 1.5  # child 2 likely, so the conditional has enough samples
  rows = 40000
  sampling = SamplingConfig(temperature=1.0)
  bcast = lambda x: jnp.broadcast_to(jnp.asarray(x), (rows,) + x.shape)
  acc = jax.jit(lambda key: accept_tree(bcast(tokens), bcast(parents), bcast(depth),
                                        jnp.full((rows,), 3), bcast(logits), key, sampling,
                                        max_depth=2))(jax.random.PRNGKey(7))
  new = np.asarray(acc.new_tokens)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  assert _p(np.bincount(new[:, 0], minlength=VOCAB), probs[0]) > 1e-3
  after_two = new[new[:, 0] == 2, 1]
  assert _p(np.bincount(after_two, minlength=VOCAB), probs[1]) > 1e-3
  after_five = new[new[:, 0] == 5, 1]
  assert _p(np.bincount(after_five, minlength=VOCAB), probs[2]) > 1e-3
  # Not a trivially passing check: the root's distribution is not the child's.
  assert _p(np.bincount(after_two, minlength=VOCAB), probs[0]) < 1e-3
  np.testing.assert_array_equal(np.asarray(acc.num_new), 1 + np.isin(new[:, 0], [2, 5])
                                + ((new[:, 0] == 2) & (new[:, 1] == 1)))


def test_accept_and_compact_writes_history_and_holds_finished_rows():
  batch, capacity, heads, dim = 2, 16, 1, 2
  lengths = jnp.asarray([3, 5], jnp.int32)
  cache = KVCache.create(1, batch, capacity, heads, dim).replace(lengths=lengths)
  tree = Tree(tokens=jnp.asarray([[0, 4, 6], [0, 4, 6]], jnp.int32),
              parents=jnp.asarray([[-1, 0, 1], [-1, 0, 1]], jnp.int32),
              depth=jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32),
              mask=jnp.ones((batch, 3, 3), bool), scores=jnp.zeros((batch, 3)),
              num_nodes=jnp.asarray([2, 2], jnp.int32),
              paths=jnp.zeros((batch, 1, 3), jnp.int32), num_leaves=jnp.ones((batch,), jnp.int32))
  logits = jnp.zeros((batch, 3, VOCAB)).at[:, 0, 4].set(9.0).at[:, 1, 6].set(9.0)
  logits = logits.at[:, 2, 2].set(9.0)

  class Out:  # what verify_trees returns, as far as acceptance reads it
    pass

  out = Out()
  out.logits, out.cache, out.taps = logits, cache, jnp.arange(batch * 3 * 2.0).reshape(
      batch, 3, 2)
  history = jnp.zeros((batch, capacity + 4), jnp.int32)
  acc, new_cache, history, advance, path_taps = accept_and_compact(
      tree, out, history, jnp.asarray([True, False]), jax.random.PRNGKey(0),
      sampling=GREEDY, max_depth=2)
  np.testing.assert_array_equal(np.asarray(acc.num_new), [3, 3])
  np.testing.assert_array_equal(np.asarray(advance), [3, 0])  # row 1 has finished
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), [6, 5])
  # Emitted tokens land right after the root (index = old length).
  np.testing.assert_array_equal(np.asarray(history[0, 4:7]), [4, 6, 2])
  np.testing.assert_array_equal(np.asarray(path_taps), np.asarray(out.taps))
