"""Straightforward numpy references of the DARTree builders (tests only).

Everything runs node by node in float64: each frontier node computes its own
corrected logits and GRU step, pairs are sorted with Python's stable sort, and
DDTree is a real best-first search with a heap. Trees come back as node lists
(tokens, parents, depths, path scores) in BFS order, plus the smallest score
margin at any cut, so that tests can tell float noise from real differences.
"""

import dataclasses
import heapq
import math

import numpy as np


@dataclasses.dataclass
class ReferenceHead:
  """Numpy copy of ``CorrectionHead`` (same layouts: z [D, E], w_out [E, V], ...)."""

  z: np.ndarray
  w_state: np.ndarray
  w_out: np.ndarray
  w_input: np.ndarray
  w_hidden: np.ndarray
  embed: np.ndarray
  num_uncorrected: int = 0

  @classmethod
  def from_head(cls, head) -> "ReferenceHead":
    get = lambda x: np.asarray(x, np.float64)
    return cls(get(head.z), get(head.w_state), get(head.w_out), get(head.w_input),
               get(head.w_hidden), get(head.embed), head.num_uncorrected)

  def gru(self, token: int, state: np.ndarray) -> np.ndarray:
    g = state.shape[0]
    gi = self.embed[token] @ self.w_input
    gh = state @ self.w_hidden
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
    reset = sigmoid(gi[:g] + gh[:g])
    update = sigmoid(gi[g:2 * g] + gh[g:2 * g])
    candidate = np.tanh(gi[2 * g:] + reset * gh[2 * g:])
    return (1.0 - update) * candidate + update * state

  def root_state(self, root: int) -> np.ndarray:
    return self.gru(root, np.zeros(self.w_hidden.shape[0]))

  def corrected(self, row: int, state: np.ndarray, base: np.ndarray) -> np.ndarray:
    """base logits [V] of depth row ``row`` + the correction under ``state``."""
    if row < self.num_uncorrected:
      return base
    hidden = self.z[row] + state @ self.w_state
    hidden = hidden / (1.0 + np.exp(-hidden))
    return base + hidden @ self.w_out


@dataclasses.dataclass
class ReferenceTree:
  """Nodes in BFS order (the root excluded): tokens, parent (0 = root), depth,
  path score; margin: the smallest score gap at any cut (inf if none)."""

  tokens: list
  parents: list
  depths: list
  scores: list
  margin: float

  def paths(self) -> dict:
    """{token path from the root: score}, an order-free view of the tree."""
    out, seqs = {}, {0: ()}
    for i, (tok, par, score) in enumerate(zip(self.tokens, self.parents, self.scores), 1):
      seqs[i] = seqs[par] + (tok,)
      out[seqs[i]] = score
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
  m = np.max(x)
  return x - m - math.log(np.sum(np.exp(x - m)))


def _candidates(base: np.ndarray, k: int) -> np.ndarray:
  """Top-k token ids of one row: logit descending, then lower id."""
  return np.argsort(-base, kind="stable")[:k]


class _Node:
  def __init__(self, token, parent, depth, score, state, index):
    self.token, self.parent, self.depth, self.score = token, parent, depth, score
    self.state, self.index = state, index


def reference_dartree(base_logits, root, head: ReferenceHead | None, *, topk: int,
                      width: int, budget: int, depth_bonus: float, fixed: bool
                      ) -> ReferenceTree:
  """DARTree node by node: fixed (quota per depth) or pruned (supertree + cut).

  With ``head=None`` the marginals are not corrected (DDTree as a beam).
  """
  base = np.asarray(base_logits, np.float64)
  num_depths, vocab = base.shape
  k = min(topk, vocab)
  cands = [_candidates(base[d], k) for d in range(num_depths)]
  root_node = _Node(int(root), None, 0, 0.0,
                    head.root_state(int(root)) if head is not None else None, 0)
  frontier, records, margin = [root_node], [], math.inf
  remaining = budget
  for d in range(num_depths):
    pairs = []
    for rank, node in enumerate(frontier):
      logits = base[d][cands[d]]
      if head is not None:
        logits = head.corrected(d, node.state, base[d])[cands[d]]
      log_probs = _log_softmax(logits)
      for j in range(k):
        pairs.append((node.score + log_probs[j], rank * k + j, node, j))
    pairs.sort(key=lambda p: (-p[0], p[1]))
    if fixed:
      quota = min(math.ceil(remaining / (num_depths - d)), len(pairs))
      remaining -= quota
    else:
      quota = min(width, len(pairs))
    if quota < 1:
      break
    if quota < len(pairs):
      margin = min(margin, pairs[quota - 1][0] - pairs[quota][0])
    frontier = []
    for score, _, parent, j in pairs[:quota]:
      token = int(cands[d][j])
      state = head.gru(token, parent.state) if head is not None else None
      node = _Node(token, parent, d + 1, score, state, len(records) + 1)
      records.append(node)
      frontier.append(node)
  kept = records
  if not fixed:
    order = sorted(records, key=lambda n: (-(n.score + depth_bonus * n.depth), n.index))
    keep = min(budget, len(order))
    if keep < len(order):
      key = lambda n: n.score + depth_bonus * n.depth
      margin = min(margin, key(order[keep - 1]) - key(order[keep]))
    kept = sorted(order[:keep], key=lambda n: n.index)
  return _as_tree(kept, margin)


def reference_ddtree(base_logits, root, *, topk: int, budget: int) -> ReferenceTree:
  """Best-first search with a heap over the (uncorrected) top-k marginals."""
  del root  # marginals do not depend on the path
  base = np.asarray(base_logits, np.float64)
  num_depths, vocab = base.shape
  k = min(topk, vocab)
  cands = [_candidates(base[d], k) for d in range(num_depths)]
  log_probs = [_log_softmax(base[d][cands[d]]) for d in range(num_depths)]
  counter = 0
  heap = []

  def push_children(node):
    nonlocal counter
    if node.depth >= num_depths:
      return
    for j in range(k):
      child = _Node(int(cands[node.depth][j]), node, node.depth + 1,
                    node.score + log_probs[node.depth][j], None, -1)
      heapq.heappush(heap, (-child.score, counter, child))
      counter += 1

  root_node = _Node(-1, None, 0, 0.0, None, 0)
  push_children(root_node)
  chosen = []
  while heap and len(chosen) < budget:
    _, _, node = heapq.heappop(heap)
    node.index = len(chosen) + 1
    chosen.append(node)
    push_children(node)
  margin = (chosen[-1].score - (-heap[0][0])) if heap else math.inf
  # BFS order: by depth, then by score (the batched builder's rank order).
  chosen.sort(key=lambda n: (n.depth, -n.score))
  return _as_tree(chosen, margin)


def reference_chain(base_logits, root, head: ReferenceHead | None) -> ReferenceTree:
  """DFlash chain (argmax of the marginals) or, with a head, Domino's chain."""
  base = np.asarray(base_logits, np.float64)
  state = head.root_state(int(root)) if head is not None else None
  tokens, scores, score, margin = [], [], 0.0, math.inf
  for d in range(base.shape[0]):
    logits = head.corrected(d, state, base[d]) if head is not None else base[d]
    top2 = np.sort(logits)[-2:]
    margin = min(margin, top2[1] - top2[0])
    token = int(np.argmax(logits))
    score += _log_softmax(logits)[token]
    tokens.append(token)
    scores.append(score)
    if head is not None:
      state = head.gru(token, state)
  n = len(tokens)
  return ReferenceTree(tokens, list(range(n)), list(range(1, n + 1)), scores, margin)


def _as_tree(nodes, margin) -> ReferenceTree:
  position = {id(n): i for i, n in enumerate(nodes, 1)}
  parents = []
  for n in nodes:
    if n.parent.depth == 0:
      parents.append(0)
    else:
      assert id(n.parent) in position, "selection is not prefix-closed"
      parents.append(position[id(n.parent)])
  return ReferenceTree([n.token for n in nodes], parents, [n.depth for n in nodes],
                       [n.score for n in nodes], margin)
