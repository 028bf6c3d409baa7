"""The reference DART ``.trie`` binary format, read and written with numpy.

Layout (little-endian; the reference writes C++ ``size_t`` as uint64 and token
ids / counts as int32)::

  uint64 order, uint64 node_count
  node_count times:
    int32 token, uint64 parent, int32 freq, uint64 n_children,
    n_children times: int32 child_token, uint64 child_index

Node 0 is the root. Records have no padding (a header is 24 bytes, a child
entry 12 bytes). The reference saves children in ``std::unordered_map``
iteration order; we keep whatever order a file has, so that loading and saving
a file reproduces it byte for byte.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dart_jax.errors import CheckpointError

HEADER_DTYPE = np.dtype([("order", "<u8"), ("node_count", "<u8")])
NODE_DTYPE = np.dtype([("token", "<i4"), ("parent", "<u8"), ("freq", "<i4"),
                       ("n_children", "<u8")])
CHILD_DTYPE = np.dtype([("token", "<i4"), ("index", "<u8")])
assert HEADER_DTYPE.itemsize == 16 and NODE_DTYPE.itemsize == 24
assert CHILD_DTYPE.itemsize == 12

# Orders above this are certainly a corrupt header, not a real model.
_MAX_ORDER = 1 << 16
# Nodes per numpy chunk when gathering or scattering records.
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class TrieArrays:
  """A trie as flat arrays, in the node and child order of its file.

  Attributes:
    order: the n-gram order stored in the header.
    tokens: int32 [N] token of each node (the root's is whatever the file has).
    parents: uint64 [N] parent field of each node, kept verbatim.
    counts: int32 [N] ``freq`` of each node.
    child_start: int64 [N+1]; node i's children are entries
      ``child_start[i]:child_start[i+1]``.
    child_tokens: int32 [E] token of each child entry.
    child_nodes: int64 [E] node index of each child entry.
  """
  order: int
  tokens: np.ndarray
  parents: np.ndarray
  counts: np.ndarray
  child_start: np.ndarray
  child_tokens: np.ndarray
  child_nodes: np.ndarray

  @property
  def num_nodes(self) -> int:
    return int(self.tokens.shape[0])


def _words_at(words: np.ndarray, offsets: np.ndarray, count: int) -> list:
  """`count` consecutive uint32 words at each word offset (chunked gathers)."""
  cols = [np.empty(offsets.shape[0], np.uint32) for _ in range(count)]
  for a in range(0, offsets.shape[0], _CHUNK):
    b = min(a + _CHUNK, offsets.shape[0])
    o = offsets[a:b]
    for j in range(count):
      cols[j][a:b] = words[o + j]
  return cols


def _u64(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  return lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))


# Words (uint32) per scan window; a record must fit in one window.
_SCAN_WINDOW = 1 << 24


@functools.lru_cache(maxsize=None)
def _compiled_scan(window: int):
  """Jitted sequential record scan over one window of words (CPU).

  A record is 6 header words + 3 words per child; the child count is the
  uint64 at header words 4-5. The scan is inherently sequential (each record's
  size is in the record), so it runs as an XLA while-loop (~0.2 us a record)
  instead of a Python loop (~3 us).
  """
  max_records = window // 6 + 1

  def scan(words, valid_words, max_nodes):
    def fits(o):
      room = valid_words - o - 6
      nc_lo = words[jnp.minimum(o + 4, window - 1)]
      nc_hi = words[jnp.minimum(o + 5, window - 1)]
      return (room >= 0) & (nc_hi == 0) & (
          nc_lo <= (jnp.maximum(room, 0) // 3).astype(jnp.uint32))

    def cond(state):
      o, i, _ = state
      return (i < max_nodes) & fits(o)

    def body(state):
      o, i, out = state
      out = out.at[i].set(o)
      nc = words[o + 4].astype(jnp.int32)
      return o + 6 + 3 * nc, i + 1, out

    out = jnp.zeros((max_records,), jnp.int32)
    return lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), out))

  try:
    device = jax.devices("cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS excludes the CPU: use the default.
    device = None
  return jax.jit(scan), device


def _scan_record_offsets(words: np.ndarray, node_count: int, path: str):
  """Word offset and child count of every node record.

  Returns:
    (node_offsets int64 [N], n_children int64 [N], end word offset).
  """
  num_words = words.shape[0]
  node_offsets = np.empty(node_count, np.int64)
  scan, device = _compiled_scan(_SCAN_WINDOW)
  base, done = 4, 0  # The 16-byte file header is 4 words.
  while done < node_count:
    valid = min(_SCAN_WINDOW, num_words - base)
    chunk = np.zeros(_SCAN_WINDOW, np.uint32)
    chunk[:max(valid, 0)] = words[base:base + max(valid, 0)]
    o, i, out = scan(jax.device_put(chunk, device), np.int32(max(valid, 0)),
                     np.int32(node_count - done))
    i = int(i)
    if i == 0:
      _raise_bad_record(words, base, done, node_count, path)
    node_offsets[done:done + i] = base + np.asarray(out[:i], np.int64)
    done += i
    base += int(o)
  n_children = _u64(*_words_at(words, node_offsets + 4, 2)).astype(np.int64)
  return node_offsets, n_children, base


def _raise_bad_record(words, base, index, node_count, path):
  size = 4 * words.shape[0]
  if base + 6 > words.shape[0]:
    raise CheckpointError(
        f"N-gram trie {path!r} is truncated: node record {index} of "
        f"{node_count} starts at byte {4 * base} but the file has "
        f"{size} bytes. Re-download or rebuild the file.")
  nc = int(_u64(words[base + 4:base + 5], words[base + 5:base + 6])[0])
  raise CheckpointError(
      f"N-gram trie {path!r} is truncated or corrupt: node {index} claims "
      f"{nc} children, which runs past the end of the file ({size} bytes). "
      "Re-download or rebuild the file.")


def read_trie(path: str | os.PathLike) -> TrieArrays:
  """Reads and validates a reference ``.trie`` file.

  Raises:
    CheckpointError: the file is missing, truncated, has trailing bytes, or
      its records do not form a tree rooted at node 0.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CheckpointError(
        f"N-gram trie file not found: {path!r}. Pass the path of a reference "
        "'.trie' file (e.g. small.trie) or build one with "
        "'python -m dart_jax.ngram build'.")
  size = os.path.getsize(path)
  if size < HEADER_DTYPE.itemsize:
    raise CheckpointError(
        f"N-gram trie {path!r} is truncated: {size} bytes, shorter than the "
        "16-byte header.")
  # Every field boundary is a multiple of 4 bytes: read the file as words.
  words = np.memmap(path, dtype="<u4", mode="r", shape=(size // 4,))
  order = int(_u64(words[0:1], words[1:2])[0])
  node_count = int(_u64(words[2:3], words[3:4])[0])
  if not 1 <= order <= _MAX_ORDER:
    raise CheckpointError(
        f"N-gram trie {path!r} has order {order} in its header; expected a "
        "small positive number. The file is not a DART .trie or is corrupt.")
  if node_count < 1 or 16 + 24 * node_count > size:
    raise CheckpointError(
        f"N-gram trie {path!r} declares {node_count} nodes, which do not fit "
        f"in its {size} bytes: the file is truncated or corrupt.")
  node_offsets, n_children, end = _scan_record_offsets(words, node_count, path)
  if 4 * end != size:
    raise CheckpointError(
        f"N-gram trie {path!r} has {size - 4 * end} unexpected trailing bytes "
        f"after its {node_count} node records: the file is corrupt.")

  token, parent_lo, parent_hi, freq = _words_at(words, node_offsets, 4)
  child_start = np.zeros(node_count + 1, np.int64)
  np.cumsum(n_children, out=child_start[1:])
  num_entries = int(child_start[-1])
  owner = np.repeat(np.arange(node_count, dtype=np.int64), n_children)
  entry_offsets = (np.repeat(node_offsets + 6, n_children)
                   + 3 * (np.arange(num_entries, dtype=np.int64)
                          - np.repeat(child_start[:-1], n_children)))
  c_token, c_lo, c_hi = _words_at(words, entry_offsets, 3)
  del words
  raw_index = _u64(c_lo, c_hi)
  arrays = TrieArrays(
      order=order,
      tokens=token.view(np.int32),
      parents=_u64(parent_lo, parent_hi),
      counts=freq.view(np.int32),
      child_start=child_start,
      child_tokens=c_token.view(np.int32),
      child_nodes=raw_index.astype(np.int64),
  )
  _validate_tree(arrays, raw_index, owner, path)
  return arrays


def _validate_tree(t: TrieArrays, raw_index: np.ndarray, owner: np.ndarray,
                   path: str) -> None:
  """Checks that child links form one tree rooted at node 0."""
  n = t.num_nodes

  def fail(what: str):
    raise CheckpointError(
        f"N-gram trie {path!r} is corrupt: {what}. Re-download or rebuild it.")

  if t.child_nodes.shape[0] != n - 1:
    fail(f"{t.child_nodes.shape[0]} child links for {n} nodes (a tree has "
         f"{n - 1})")
  if n == 1:
    return
  if np.any(raw_index >= n) or np.any(raw_index == 0):
    fail("a child index is out of range or points at the root")
  seen = np.bincount(t.child_nodes, minlength=n)
  if np.any(seen[1:] != 1):
    fail("a node is the child of several nodes")
  if np.any(t.parents[t.child_nodes] != owner.astype(np.uint64)):
    fail("a node's parent field disagrees with its parent's child list")
  if np.any(t.tokens[t.child_nodes] != t.child_tokens):
    fail("a node's token disagrees with the token in its parent's child list")
  # Duplicate tokens within one child list.
  key = np.sort(sort_key(owner, t.child_tokens))
  if np.any(key[1:] == key[:-1]):
    fail("a node lists the same child token twice")
  # Every node reachable from the root (no detached cycles).
  reached = 1
  level = np.zeros(1, np.int64)
  while level.size:
    level = children_of(t.child_start, t.child_nodes, level)
    reached += level.size
    if reached > n:
      break
  if reached != n:
    fail("some nodes are not reachable from the root")


def children_of(child_start: np.ndarray, child_nodes: np.ndarray,
                nodes: np.ndarray) -> np.ndarray:
  """Child node ids of `nodes`, grouped by parent in the given order."""
  return child_nodes[entries_of(child_start, nodes)]


def entries_of(child_start: np.ndarray, nodes: np.ndarray) -> np.ndarray:
  """Child-entry indices of `nodes`, grouped by parent in the given order."""
  starts = child_start[nodes]
  lengths = child_start[nodes + 1] - starts
  total = int(lengths.sum())
  within = np.arange(total, dtype=np.int64) - np.repeat(
      np.cumsum(lengths) - lengths, lengths)
  return np.repeat(starts, lengths) + within


def sort_key(owner: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """int64 key ordering child entries by (owner node, token as uint32)."""
  return (owner.astype(np.int64) << 32) | tokens.astype(np.int64) & 0xFFFFFFFF


def write_trie(path: str | os.PathLike, t: TrieArrays) -> None:
  """Writes `t` in the reference ``.trie`` layout, child order as stored."""
  path = os.fspath(path)
  n = t.num_nodes
  header = np.array([(t.order, n)], HEADER_DTYPE)
  try:
    f = open(path, "wb")
  except OSError as e:
    raise CheckpointError(f"Cannot write N-gram trie to {path!r}: {e}") from e

  def split64(x):
    x = np.asarray(x).astype(np.uint64)
    return ((x & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            (x >> np.uint64(32)).astype(np.uint32))

  with f:
    f.write(header.tobytes())
    # Records are whole uint32 words: scatter word columns into one buffer.
    for a in range(0, n, _CHUNK):
      b = min(a + _CHUNK, n)
      nc = t.child_start[a + 1:b + 1] - t.child_start[a:b]
      sizes = 6 + 3 * nc
      rec_off = np.cumsum(sizes) - sizes
      out = np.empty(int(sizes.sum()), "<u4")
      parent_lo, parent_hi = split64(t.parents[a:b])
      nc_lo, nc_hi = split64(nc)
      columns = (t.tokens[a:b].view(np.uint32), parent_lo, parent_hi,
                 t.counts[a:b].view(np.uint32), nc_lo, nc_hi)
      for j, col in enumerate(columns):
        out[rec_off + j] = col
      e0, e1 = int(t.child_start[a]), int(t.child_start[b])
      if e1 > e0:
        entry_off = (np.repeat(rec_off + 6, nc)
                     + 3 * (np.arange(e1 - e0, dtype=np.int64)
                            - np.repeat(t.child_start[a:b] - e0, nc)))
        index_lo, index_hi = split64(t.child_nodes[e0:e1])
        out[entry_off] = t.child_tokens[e0:e1].view(np.uint32)
        out[entry_off + 1] = index_lo
        out[entry_off + 2] = index_hi
      f.write(out.tobytes())
