"""Vectorised n-gram counting and pruning with the reference semantics.

Counting (``docs/algorithms.md``, "DART"): for every start ``s`` of a sequence, the window
``seq[s:s+order]`` (shorter at the end of the sequence) is inserted into a trie
and every node on its path, root included, gets +1. So ``count(g)`` is the
number of windows that begin with ``g``: the number of occurrences of ``g``
inside one sequence, for ``len(g) <= order``; the root counts all tokens.
"""

from typing import Sequence

import numpy as np

from dart_jax.errors import InputError
from dart_jax.ngram.trie_format import TrieArrays, entries_of

_INT32_MAX = np.iinfo(np.int32).max


def _bfs_arrays(order: int, tokens: np.ndarray, parents: np.ndarray,
                counts: np.ndarray) -> TrieArrays:
  """TrieArrays for nodes already in BFS order (children grouped by parent)."""
  n = tokens.shape[0]
  n_children = np.bincount(parents[1:], minlength=n).astype(np.int64)
  child_start = np.zeros(n + 1, np.int64)
  np.cumsum(n_children, out=child_start[1:])
  return TrieArrays(
      order=order,
      tokens=tokens.astype(np.int32),
      parents=parents.astype(np.uint64),
      counts=counts.astype(np.int32),
      child_start=child_start,
      child_tokens=tokens[1:].astype(np.int32),
      child_nodes=np.arange(1, n, dtype=np.int64),
  )


def count_ngrams(tokens: np.ndarray, lengths: np.ndarray,
                 order: int) -> TrieArrays:
  """Counts all windows of the concatenated sequences.

  Args:
    tokens: int [T] all sequences concatenated.
    lengths: int [S] length of each sequence (sum = T).
    order: the n-gram order n >= 1.

  Returns:
    The trie in BFS order, each node's children sorted by token; root token 0
    and parent 0 as the reference writes them.
  """
  tokens = np.asarray(tokens, np.int64).reshape(-1)
  lengths = np.asarray(lengths, np.int64).reshape(-1)
  if order < 1:
    raise InputError(f"N-gram order must be >= 1, got {order}.")
  if np.any(lengths < 0) or int(lengths.sum()) != tokens.shape[0]:
    raise InputError("Sequence lengths must be >= 0 and sum to the number of "
                     "tokens.")
  if tokens.size and (tokens.min() < 0 or tokens.max() > _INT32_MAX):
    raise InputError("Token ids must be in [0, 2**31); got "
                     f"[{tokens.min()}, {tokens.max()}].")
  total = tokens.shape[0]
  if total > _INT32_MAX:
    raise InputError(
        f"{total} tokens overflow the int32 counts of the .trie format; build "
        "from less data (or split it and prune with reduce()).")
  # Dense token ranks keep the composite keys small (see _group).
  if total and tokens.max() < (1 << 24):
    present = np.bincount(tokens) > 0
    vocab_ids = np.flatnonzero(present)
    dense = (np.cumsum(present) - 1)[tokens]
  else:
    vocab_ids, dense = np.unique(tokens, return_inverse=True)
  vocab = max(int(vocab_ids.shape[0]), 1)

  # Tokens left in the sequence from each start (window length = min(order, .)).
  seq_end = np.repeat(np.cumsum(lengths), lengths)
  remaining = seq_end - np.arange(total, dtype=np.int64)

  all_tokens = [np.zeros(1, np.int64)]
  all_parents = [np.zeros(1, np.int64)]
  all_counts = [np.array([total], np.int64)]
  starts = np.arange(total, dtype=np.int64)
  prev_local = np.zeros(total, np.int64)  # Node at depth m-1, level-local id.
  prev_offset, next_id = 0, 1
  for m in range(1, order + 1):
    keep = remaining[starts] >= m
    starts, prev_local = starts[keep], prev_local[keep]
    if not starts.size:
      break
    key = prev_local * vocab + dense[starts + m - 1]
    uniq, cnt, inverse = _group(key, need_inverse=m < order)
    all_tokens.append(vocab_ids[uniq % vocab])
    all_parents.append(prev_offset + uniq // vocab)
    all_counts.append(cnt)
    prev_local = inverse
    prev_offset, next_id = next_id, next_id + uniq.shape[0]
  return _bfs_arrays(order, np.concatenate(all_tokens),
                     np.concatenate(all_parents), np.concatenate(all_counts))


def _group(key: np.ndarray, need_inverse: bool):
  """Sorted unique keys, their counts, and each key's group (or None).

  Sorting (key << b | position) as one int64 is several times faster than
  np.unique's argsort, so it is used whenever the packed value fits.
  """
  n = key.shape[0]
  index_bits = max(1, (n - 1).bit_length())
  if not need_inverse:
    sorted_key, order = np.sort(key), None
  elif int(key.max()) < (1 << (63 - index_bits)):
    packed = (key << index_bits) | np.arange(n, dtype=np.int64)
    packed.sort()
    sorted_key = packed >> index_bits
    order = packed & ((1 << index_bits) - 1)
  else:
    order = np.argsort(key)
    sorted_key = key[order]
  first = np.empty(n, bool)
  first[0] = True
  np.not_equal(sorted_key[1:], sorted_key[:-1], out=first[1:])
  bounds = np.flatnonzero(first)
  counts = np.diff(np.append(bounds, n))
  inverse = None
  if need_inverse:
    inverse = np.empty(n, np.int64)
    inverse[order] = np.cumsum(first) - 1
  return sorted_key[bounds], counts, inverse


def bfs_levels(t: TrieArrays, max_depth: int | None = None) -> list[np.ndarray]:
  """Node ids level by level from the root, children in stored order."""
  levels = [np.zeros(1, np.int64)]
  while max_depth is None or len(levels) <= max_depth:
    entries = entries_of(t.child_start, levels[-1])
    if not entries.size:
      break
    levels.append(t.child_nodes[entries])
  return levels


def reduce_trie(t: TrieArrays, threshold: int) -> TrieArrays:
  """Prunes children with count < `threshold`, as the reference does.

  A child is kept if its ORIGINAL count is >= threshold (and its parent is
  kept). Every kept node's count is lowered by the counts of all dropped
  subtrees below it, so the probabilities renormalise over what is kept. As in
  the reference, the new root starts from 0 (its count becomes minus the
  dropped total); the root count is never used by a query. The result is in
  BFS order, each node's kept children in their stored order.
  """
  threshold = int(threshold)
  n = t.num_nodes
  levels = [np.zeros(1, np.int64)]
  level_parents = [np.zeros(1, np.int64)]
  removed = np.zeros(n, np.int64)  # Dropped count below each kept node.
  while True:
    parents_here = levels[-1]
    entries = entries_of(t.child_start, parents_here)
    if not entries.size:
      break
    kids = t.child_nodes[entries]
    lengths = t.child_start[parents_here + 1] - t.child_start[parents_here]
    owner = np.repeat(parents_here, lengths)
    keep = t.counts[kids] >= threshold
    np.add.at(removed, owner[~keep], t.counts[kids[~keep]].astype(np.int64))
    if not keep.any():
      break
    levels.append(kids[keep])
    level_parents.append(owner[keep])
  # Propagate dropped totals from deep levels up to every kept ancestor.
  for kids, owner in zip(levels[:0:-1], level_parents[:0:-1]):
    np.add.at(removed, owner, removed[kids])

  old_ids = np.concatenate(levels)
  new_of_old = np.full(n, -1, np.int64)
  new_of_old[old_ids] = np.arange(old_ids.shape[0])
  new_counts = t.counts[old_ids].astype(np.int64) - removed[old_ids]
  new_counts[0] = -removed[0]
  new_tokens = t.tokens[old_ids].astype(np.int64)
  new_tokens[0] = 0
  new_parents = new_of_old[np.concatenate(level_parents)]
  new_parents[0] = 0
  return _bfs_arrays(t.order, new_tokens, new_parents, new_counts)


def concat_sequences(sequences: Sequence[Sequence[int]] | np.ndarray):
  """(tokens [T], lengths [S]) from a list of sequences or a 2-D array."""
  if isinstance(sequences, np.ndarray):
    if sequences.ndim == 1:
      sequences = [sequences]
    elif sequences.ndim != 2:
      raise InputError("Sequences must be a list of 1-D token arrays or a 2-D "
                       f"array; got an array of shape {sequences.shape}.")
  arrays = []
  for s in sequences:
    a = np.asarray(s)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
      raise InputError("Each sequence must be a 1-D list/array of integer token "
                       f"ids; got dtype {a.dtype} and shape {a.shape}.")
    arrays.append(a.astype(np.int64))
  lengths = np.array([a.shape[0] for a in arrays], np.int64)
  tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
  return tokens, lengths
