"""Verification: one target pass over a draft tree, lossless acceptance, compaction.

Every speculative method verifies the same way (``docs/algorithms.md``,
"Verification"): ``verify_trees`` runs the target over ``[root] + tree`` with
the tree's ancestor mask, ``accept_and_compact`` accepts a path, writes the
emitted tokens to the history and keeps only the accepted rows of the cache.

Acceptance (greedy and sampling):

Sample-and-match: the target draws one token at every tree node (argmax at
temperature 0, a sample from the processed distribution otherwise); walking from
the root, a child is accepted while its token equals the token drawn at its
parent, and the token drawn at the last accepted node is the next root. Along
the accepted path every token is exactly a draw from the target given its prefix,
so the output distribution is the target's at any temperature. It is equivalent to trying the distinct children
in turn with probability p(x) and renormalising after each rejection.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.models import layers
from dart_jax.models.transformer import KVCache
from dart_jax.sampling import SamplingConfig, sample
from dart_jax.tree import Tree


class Acceptance(NamedTuple):
  """Result of verifying one tree per sequence.

  path: [B, A] node indices of the accepted path, root first (A = max depth + 1);
    entries past ``num_new`` are 0.
  num_new: [B] tokens emitted this round = accepted draft nodes + 1 (the bonus
    token drawn at the last accepted node).
  new_tokens: [B, A] emitted tokens: the accepted draft tokens, then the bonus
    token; entries past ``num_new`` are 0.
  """

  path: jax.Array
  num_new: jax.Array
  new_tokens: jax.Array


def accept_tree(tokens: jax.Array, parents: jax.Array, depth: jax.Array,
                num_nodes: jax.Array, logits: jax.Array, key: jax.Array,
                sampling: SamplingConfig, max_depth: int) -> Acceptance:
  """Sample-and-match acceptance for a batch of trees.

  Args:
    tokens: [B, N+1] node tokens (0 = root).
    parents: [B, N+1] parent index, -1 for the root and padding; valid nodes
      satisfy ``parents[i] < i``.
    depth: [B, N+1] node depth (root 0).
    num_nodes: [B] valid draft nodes (indices 1..num_nodes).
    logits: [B, N+1, V] target logits at every node.
    key: PRNG key (unused when greedy).
    sampling: target sampling configuration.
    max_depth: static bound on ``depth``.
  Returns:
    ``Acceptance`` with A = max_depth + 1.
  """
  batch, n1 = tokens.shape
  drawn = sample(key, logits, sampling)  # [B, N+1]
  node = jnp.arange(n1)
  valid = (node[None, :] >= 1) & (node[None, :] <= num_nodes[:, None])
  safe_parent = jnp.maximum(parents, 0)
  matches = valid & (tokens == jnp.take_along_axis(drawn, safe_parent, axis=1))
  accepted = node[None, :] == 0
  # A node is accepted when it matches and its parent is accepted; one pass per
  # level settles every depth.
  for _ in range(max_depth):
    accepted = (node[None, :] == 0) | (
        matches & jnp.take_along_axis(accepted, safe_parent, axis=1))
  # Children of a node carry distinct tokens, so at most one child matches: the
  # accepted nodes form a single path and the deepest one ends it.
  last = jnp.argmax(jnp.where(accepted, depth, -1), axis=1)  # [B]
  last_depth = jnp.take_along_axis(depth, last[:, None], axis=1)[:, 0]
  # path[b, d] = the ancestor of `last` at depth d, by walking parents upward.
  levels = jnp.arange(max_depth + 1)
  path = jnp.zeros((batch, max_depth + 1), jnp.int32)
  cur = last
  for _ in range(max_depth + 1):
    cur_depth = jnp.take_along_axis(depth, cur[:, None], axis=1)[:, 0]
    path = jnp.where(levels[None, :] == cur_depth[:, None], cur[:, None], path)
    cur = jnp.maximum(jnp.take_along_axis(parents, cur[:, None], axis=1)[:, 0], 0)
  path = jnp.where(levels[None, :] <= last_depth[:, None], path, 0)
  bonus = jnp.take_along_axis(drawn, last[:, None], axis=1)[:, 0]
  # Emitted: the tokens of path[1..last_depth], then the bonus token.
  path_tokens = jnp.take_along_axis(tokens, path, axis=1)
  shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)], 1)
  new_tokens = jnp.where(levels[None, :] < last_depth[:, None], shifted, 0)
  new_tokens = jnp.where(levels[None, :] == last_depth[:, None], bonus[:, None], new_tokens)
  return Acceptance(path=path.astype(jnp.int32), num_new=(last_depth + 1).astype(jnp.int32),
                    new_tokens=new_tokens.astype(jnp.int32))


def verify_trees(target_graphdef, target_params, cache: KVCache, tree: Tree, *,
                 attend_len: int, taps: tuple[int, ...], attn_impl: str):
  """One target pass over ``[root] + tree`` at positions ``length + depth``.

  tree: a batched ``Tree`` (tokens / depth [B, N+1], mask [B, N+1, N+1]).
  Returns the model output: logits [B, N+1, V], taps [B, N+1, n*H] of the
  ``taps`` layers, and the cache with the tree's rows written past ``lengths``.
  """
  target_model = nnx.merge(target_graphdef, target_params)
  return target_model(tree.tokens, cache.lengths[:, None] + tree.depth, cache, tree.mask,
                      attend_len=attend_len, taps=taps, attn_impl=attn_impl)


def accept_and_compact(tree: Tree, out, history: jax.Array, active: jax.Array,
                       key: jax.Array, *, sampling: SamplingConfig, max_depth: int):
  """Acceptance, history update and KV compaction after ``verify_trees``.

  history: [B, C] committed tokens with the root at ``cache.lengths``; the
  emitted tokens go right after it, so the new root lands at the new length.
  active: [B] rows still decoding (a finished row's cache does not advance).
  Returns (``Acceptance``, compacted cache, history, advance [B], taps of the
  accepted path [B, A, n*H], root first).
  """
  acc = accept_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, out.logits,
                    key, sampling, max_depth=max_depth)
  advance = acc.num_new * active.astype(jnp.int32)
  history = layers.write_rows(history, acc.new_tokens, out.cache.lengths + 1)
  cache = out.cache.compact(acc.path, advance)
  return acc, cache, history, advance, layers.gather_rows(out.taps, acc.path)
