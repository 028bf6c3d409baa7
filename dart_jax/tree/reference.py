"""Plain numpy/Python reference of the DART tree search (tests, benchmarks).

Written the way the reference release's C++ searcher works: paths are token
tuples, every beam member queries `NGram.probability` on its own context, and
ranking uses Python sorts with the tie rules documented in `dart_search`.
Scores are float32 with the same operation order as the reference.
"""

import dataclasses
import math
from typing import Sequence

import numpy as np

from dart_jax.ngram.model import NGram
from dart_jax.tree.config import TreeConfig


@dataclasses.dataclass
class ReferenceTree:
  """Result of the reference search.

  Attributes:
    paths: token path (tuple, root excluded) of each draft node, BFS order;
      node i+1 of the tree is paths[i].
    scores: float32 [n] score of each node.
    tokens, parents, depth: int [N+1] padded like `Tree`.
    mask: bool [N+1, N+1] ancestor-or-self.
    leaf_paths: node-index rows root -> leaf of each leaf, in node order.
    margins: at each cut (every beam cut, then the final one) the score gap
      between the last kept and the first dropped entry when both are in the
      same EOS class (inf otherwise). A float-noise difference smaller than
      the smallest margin cannot change the result.
  """
  paths: list
  scores: np.ndarray
  tokens: np.ndarray
  parents: np.ndarray
  depth: np.ndarray
  mask: np.ndarray
  leaf_paths: list
  margins: list


def reference_candidates(logits: np.ndarray, config: TreeConfig,
                         d2t: np.ndarray | None = None):
  """numpy twin of `dart_search.level_candidates`."""
  logits = np.asarray(logits, np.float32)
  index = np.argsort(-logits, axis=-1, kind="stable")[:, :config.topk]
  values = np.take_along_axis(logits, index, axis=-1)
  tokens = index if d2t is None else index + np.asarray(d2t)[index]
  exp = np.exp(values - values.max(axis=-1, keepdims=True))
  probs = exp / exp.sum(axis=-1, keepdims=True)
  return tokens.astype(np.int64), np.log(probs + np.float32(config.eps))


def _margin(ranked: list, kept: int, eos_id) -> float:
  if kept >= len(ranked):
    return math.inf
  last, first_out = ranked[kept - 1], ranked[kept]
  if (last[0][-1] == eos_id) != (first_out[0][-1] == eos_id):
    return math.inf
  return abs(float(last[1]) - float(first_out[1]))


def reference_search_candidates(tokens: np.ndarray, log_probs: np.ndarray,
                                context: Sequence[int], ngram: NGram | None,
                                config: TreeConfig) -> ReferenceTree:
  """The beam search from per-level candidates.

  Args:
    tokens: int [D+1, k] candidate target ids per level.
    log_probs: float32 [D+1, k] log(p + eps) per candidate.
    context: the real committed tokens, ending with the root.
    ngram: host `NGram` or None.
    config: the search config.
  """
  context = [int(t) for t in context]
  num_levels, k = tokens.shape
  eps = np.float32(config.eps)
  ngram_weight = np.float32(config.ngram_weight)
  eos = config.search_eos_id
  beam = [((), np.float32(0.0))]
  records = []  # (path, score, level, record index)
  margins = []
  for level in range(num_levels):
    level_tokens = [int(t) for t in tokens[level]]
    level_weight = np.float32(config.level_weight(level))
    logit_term = np.asarray(log_probs[level], np.float32) * np.float32(
        config.logit_weight(level))
    children = []  # (path, score, flat index)
    for b, (path, score) in enumerate(beam):
      inner = logit_term
      if level > 0 and ngram is not None:
        if config.ngram_weight > 0:
          full = context + list(path)
          ctx = full[max(len(full) - (ngram.order - 1), 0):] if ngram.order > 1 else []
          p_ngram, _ = ngram.probability(ctx, level_tokens)
        else:
          p_ngram = np.zeros(k, np.float32)
        inner = logit_term + np.log(p_ngram + eps) * ngram_weight
      scores = score + level_weight * inner
      for j, token in enumerate(level_tokens):
        children.append((path + (token,), scores[j], b * k + j))
    base = len(records)
    records.extend((p, s, level, base + f) for p, s, f in children)
    if level + 1 < num_levels:
      ranked = sorted(children, key=lambda c: (c[0][-1] == eos, -c[1], c[2]))
      width = min(config.beam_width, len(children))
      margins.append(_margin(ranked, width, eos))
      beam = [(p, s) for p, s, _ in ranked[:width]]

  ranked = sorted(records, key=lambda r: (-r[1], r[3]))
  keep = min(config.remain_total, len(ranked))
  margins.append(_margin([(r[0], r[1]) for r in ranked], keep, object()))
  kept = sorted(enumerate(ranked[:keep]), key=lambda e: (e[1][2], e[0]))
  paths = [r[0] for _, r in kept]
  scores = np.array([r[1] for _, r in kept], np.float32)

  size = config.remain_total + 1
  node_of_path = {(): 0}
  node_tokens = np.zeros(size, np.int64)
  parents = np.full(size, -1, np.int64)
  depth = np.zeros(size, np.int64)
  node_tokens[0] = context[-1]
  for i, path in enumerate(paths, start=1):
    node_of_path[path] = i
    node_tokens[i] = path[-1]
    parents[i] = node_of_path[path[:-1]]  # KeyError = not prefix-closed.
    depth[i] = len(path)
  mask = np.eye(size, dtype=bool)
  for i in range(1, len(paths) + 1):
    j = parents[i]
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  has_child = set(int(p) for p in parents[1:len(paths) + 1])
  leaf_paths = []
  for i in range(1, len(paths) + 1):
    if i not in has_child:
      chain, j = [], i
      while j >= 0:
        chain.append(j)
        j = parents[j]
      leaf_paths.append(chain[::-1])
  return ReferenceTree(paths=paths, scores=scores, tokens=node_tokens,
                       parents=parents, depth=depth, mask=mask,
                       leaf_paths=leaf_paths, margins=margins)


def reference_search(logits: np.ndarray, context: Sequence[int],
                     ngram: NGram | None, config: TreeConfig,
                     d2t: np.ndarray | None = None) -> ReferenceTree:
  """numpy reference of `dart_search` (context = the real tokens only)."""
  tokens, log_probs = reference_candidates(logits, config, d2t)
  return reference_search_candidates(tokens, log_probs, context, ngram, config)
