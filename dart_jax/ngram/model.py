"""`NGram`: the host-side n-gram model of DART (``docs/algorithms.md``, "DART")."""

import os
from typing import Sequence

import numpy as np

from dart_jax.errors import InputError
from dart_jax.ngram import counts as counts_lib
from dart_jax.ngram import trie_format
from dart_jax.ngram.table import NGramTable
from dart_jax.ngram.trie_format import TrieArrays
from dart_jax.io import embedded_ngram_path


class NGram:
  """A count trie with the reference back-off query.

  The node arrays keep the node and child order they were built or loaded
  with, so ``load_trie`` followed by ``save_trie`` reproduces a file byte for
  byte. Models built here are in BFS order with children sorted by token.

  Query ``P(t | ctx)``: for m = min(order-1, len(ctx)) down to 1, if the last m
  context tokens are a trie node, every token not matched yet that is a child
  of it gets ``float32(count(child)) * (1.0f / float32(count(node)))`` (the
  reference multiplies by the float32 reciprocal) and matched length m; tokens
  never matched get 0. There is no discounting and no unigram fallback.
  One deliberate difference: a child of count 0 (possible after `reduce`) has
  probability 0, where the reference computes 0 * (1/0) = NaN when the
  context node's count is 0 too.
  """

  def __init__(self, arrays: TrieArrays):
    self._t = arrays
    self._sorted = None  # (tokens, nodes) per child range, sorted by token.

  # ---------------------------------------------------------------- building
  @classmethod
  def build(cls, sequences: Sequence[Sequence[int]] | np.ndarray,
            order: int = 3) -> "NGram":
    """Counts every window of every sequence (vectorised numpy).

    Args:
      sequences: token-id sequences (lists or 1-D arrays, or a 2-D array of
        equal-length rows); each is counted on its own, windows never cross
        sequence boundaries.
      order: n, the longest n-gram stored.
    """
    tokens, lengths = counts_lib.concat_sequences(sequences)
    return cls(counts_lib.count_ngrams(tokens, lengths, order))

  @classmethod
  def from_arrays(cls, tokens: np.ndarray, lengths: np.ndarray,
                  order: int = 3) -> "NGram":
    """Like `build` for already concatenated tokens [T] and lengths [S]."""
    return cls(counts_lib.count_ngrams(tokens, lengths, order))

  @classmethod
  def load_trie(cls, path: str | os.PathLike) -> "NGram":
    """Loads a reference ``.trie`` file (raises CheckpointError if corrupt)."""
    return cls(trie_format.read_trie(path))

  def save_trie(self, path: str | os.PathLike) -> None:
    """Writes the reference ``.trie`` format (node and child order kept)."""
    trie_format.write_trie(path, self._t)

  def reduce(self, threshold: int) -> "NGram":
    """Prunes n-grams with count < threshold (see `counts.reduce_trie`)."""
    return NGram(counts_lib.reduce_trie(self._t, threshold))

  # -------------------------------------------------------------- inspection
  @property
  def order(self) -> int:
    return self._t.order

  @property
  def arrays(self) -> TrieArrays:
    return self._t

  @property
  def num_nodes(self) -> int:
    """Trie nodes, root included (stored n-grams = num_nodes - 1)."""
    return self._t.num_nodes

  def __repr__(self) -> str:
    return f"NGram(order={self.order}, nodes={self.num_nodes})"

  def _sorted_children(self):
    if self._sorted is None:
      t = self._t
      owner = np.repeat(np.arange(t.num_nodes, dtype=np.int64),
                        np.diff(t.child_start))
      key = trie_format.sort_key(owner, t.child_tokens)
      if np.all(key[1:] > key[:-1]):  # Already sorted (built or BFS files).
        self._sorted = (t.child_tokens.astype(np.int64), t.child_nodes)
      else:
        perm = np.argsort(key)
        self._sorted = (t.child_tokens[perm].astype(np.int64),
                        t.child_nodes[perm])
    return self._sorted

  def _child(self, node: int, token: int) -> int:
    """Child of `node` with `token`, or -1."""
    tokens, nodes = self._sorted_children()
    lo, hi = int(self._t.child_start[node]), int(self._t.child_start[node + 1])
    pos = lo + int(np.searchsorted(tokens[lo:hi], token))
    return int(nodes[pos]) if pos < hi and tokens[pos] == token else -1

  def node(self, gram: Sequence[int]) -> int:
    """Node index of the n-gram `gram` (root for ()), or -1 if absent."""
    node = 0
    for token in gram:
      node = self._child(node, int(token))
      if node < 0:
        return -1
    return node

  def count(self, gram: Sequence[int]) -> int:
    """count(gram) as stored (0 if absent)."""
    node = self.node(gram)
    return int(self._t.counts[node]) if node >= 0 else 0

  # ------------------------------------------------------------------ query
  def probability(self, context: Sequence[int],
                  tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Back-off probabilities of `tokens` after `context`.

    Args:
      context: the preceding token ids; only the last order-1 are used.
      tokens: candidate token ids [T].

    Returns:
      (probs float32 [T], matched_len int32 [T]); matched_len 0 = no match.
    """
    context = np.asarray(context, np.int64).reshape(-1)
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim != 1:
      raise InputError(f"tokens must be 1-D, got shape {tokens.shape}.")
    probs = np.zeros(tokens.shape[0], np.float32)
    matched = np.zeros(tokens.shape[0], np.int32)
    if not context.size or not tokens.size:
      return probs, matched
    child_tokens, child_nodes = self._sorted_children()
    t = self._t
    for m in range(min(self.order - 1, context.shape[0]), 0, -1):
      node = self.node(context[context.shape[0] - m:])
      if node < 0:
        continue
      lo, hi = int(t.child_start[node]), int(t.child_start[node + 1])
      if lo == hi:
        continue
      pos = np.minimum(lo + np.searchsorted(child_tokens[lo:hi], tokens),
                       hi - 1)
      hit = (child_tokens[pos] == tokens) & (matched == 0)
      with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.float32(1.0) / np.float32(t.counts[node])
        child_counts = t.counts[child_nodes[pos[hit]]].astype(np.float32)
        # A pruned node can keep a child of count 0 while its own count is 0:
        # the reference then computes 0 * inf = NaN; we return 0.
        probs[hit] = np.where(child_counts == 0, np.float32(0),
                              child_counts * inv)
      matched[hit] = m
    return probs, matched

  # ------------------------------------------------------------------ device
  def to_table(self, load_factor: float = 1.0) -> NGramTable:
    """The device lookup table for `dart_search` (see `dart_jax.ngram.table`)."""
    return NGramTable.from_ngram(self, load_factor)

  def reference_memory_bytes(self) -> int:
    """Estimated RAM of the reference C++ in-memory trie for this model.

    Per node: ``sizeof(TrieNode)`` = 80 bytes on 64-bit libstdc++ (a 56-byte
    ``std::unordered_map`` + token + parent + freq, padded), plus per child
    link one hash node (8-byte next pointer + 16-byte pair, ~32 bytes with
    malloc overhead) and about one 8-byte bucket pointer.
    """
    return 80 * self.num_nodes + (32 + 8) * (self.num_nodes - 1)


def load_ngram(path: str | os.PathLike | None = None) -> NGram:
  """A reference ``.trie`` file; None = the N-gram shipped for the embedded target."""
  if path is None:
    path = embedded_ngram_path()
  return NGram.load_trie(path)
