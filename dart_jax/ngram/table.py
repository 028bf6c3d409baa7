"""`NGramTable`: the n-gram trie as per-depth hash tables, queried inside jit.

Why hashing: on CPU and accelerators alike a lookup in a large table is bound
by dependent memory reads and gather throughput. A binary search over sorted
children costs ~17 dependent reads per lookup; here a lookup is one read of
a bucket start plus one small contiguous window, with the window length fixed
at build time so shapes are static. Lookups are exact (full keys compared).

Layout. Every stored n-gram is a key (parent node id, token) with a count;
its node id is its row in ``keys`` / ``counts`` (row 0 is the root, a dummy
key). The keys of depth d (1..order) are hashed into ``size[d-1]`` buckets
and stored sorted by bucket, so bucket h of depth d holds the rows
``bucket_start[bucket_offset + h] : bucket_start[bucket_offset + h + 1]``.
A lookup reads ``window[d-1]`` (= the largest bucket of that depth) rows from
the bucket start; a key is unique, so any full-key match in the window is the
answer. ``keys`` is padded so windows never run off the end.

Memory: 8 (key) + 4 (count) bytes per stored n-gram + 4 per bucket, about
16 bytes per n-gram at the default load factor 1.0 (the reference C++ trie
holds ~120 bytes per n-gram in RAM; its .trie file 36).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from dart_jax.errors import ConfigError
from dart_jax.ngram.trie_format import entries_of

_INT32_MAX = np.iinfo(np.int32).max


def hash_pair(node, token, xp):
  """32-bit hash of (node, token); identical in numpy (xp=np) and jnp."""
  u32 = xp.uint32
  h = node.astype(u32) * u32(0x9E3779B1) ^ (token.astype(u32) + u32(0x7F4A7C15))
  h = h ^ (h >> u32(16))
  h = h * u32(0x85EBCA6B)
  h = h ^ (h >> u32(13))
  h = h * u32(0xC2B2AE35)
  return h ^ (h >> u32(16))


@struct.dataclass
class NGramTable:
  """Device n-gram table (a pytree; the level layout is static).

  Attributes:
    keys: int32 [K, 2] (parent node id, token) of each stored n-gram.
    counts: int32 [K] count of each stored n-gram.
    bucket_start: int32 [sum(size) + 1] first key row of each bucket.
    bucket_offset: first bucket of each depth 1..order.
    size: buckets of each depth.
    window: rows read per lookup at each depth (largest bucket).
    order: the n-gram order n.
    num_ngrams: stored n-grams (trie nodes other than the root).
  """
  keys: jax.Array
  counts: jax.Array
  bucket_start: jax.Array
  bucket_offset: tuple[int, ...] = struct.field(pytree_node=False)
  size: tuple[int, ...] = struct.field(pytree_node=False)
  window: tuple[int, ...] = struct.field(pytree_node=False)
  order: int = struct.field(pytree_node=False)
  num_ngrams: int = struct.field(pytree_node=False)

  @classmethod
  def from_ngram(cls, ngram, load_factor: float = 1.0) -> "NGramTable":
    """Builds the table from a host `NGram` (any node / child order).

    Args:
      ngram: the host model.
      load_factor: keys per bucket on average; lower means shorter windows
        (faster lookups) and 4 / load_factor bytes per n-gram of bucket index.
    """
    if not 0.1 <= load_factor <= 4.0:
      raise ConfigError(f"load_factor must be in [0.1, 4], got {load_factor}.")
    t = ngram.arrays
    new_id = np.full(t.num_nodes, -1, np.int64)
    new_id[0] = 0
    keys, counts = [np.array([[-1, -1]], np.int32)], [np.zeros(1, np.int32)]
    starts, offsets, sizes, windows = [], [], [], []
    num_keys, num_buckets = 1, 0
    parents = np.zeros(1, np.int64)
    for _ in range(t.order):
      lengths = t.child_start[parents + 1] - t.child_start[parents]
      entries = entries_of(t.child_start, parents)
      if not entries.size:
        break
      nodes = t.child_nodes[entries]
      parent_ids = np.repeat(new_id[parents], lengths)
      tokens = t.tokens[nodes].astype(np.int32)
      n = nodes.shape[0]
      size = max(math.ceil(n / load_factor), 1)
      bucket = (hash_pair(parent_ids, tokens, np) % np.uint32(size)).astype(np.int64)
      perm = np.argsort(bucket, kind="stable")
      per_bucket = np.bincount(bucket, minlength=size)
      starts.append(num_keys + np.cumsum(per_bucket) - per_bucket)
      keys.append(np.stack([parent_ids[perm], tokens[perm]], axis=1).astype(
          np.int32))
      counts.append(t.counts[nodes[perm]].astype(np.int32))
      new_id[nodes[perm]] = num_keys + np.arange(n)
      offsets.append(num_buckets)
      sizes.append(size)
      windows.append(int(per_bucket.max()))
      num_keys += n
      num_buckets += size
      if num_keys + num_buckets > _INT32_MAX:
        raise ConfigError(
            "N-gram table exceeds int32 indexing; prune the model with "
            "NGram.reduce(threshold) first.")
      parents = nodes
    pad = max(windows, default=1)
    keys.append(np.full((pad, 2), -1, np.int32))
    counts.append(np.zeros(pad, np.int32))
    starts.append(np.array([num_keys], np.int64))
    return cls(keys=jnp.asarray(np.concatenate(keys)),
               counts=jnp.asarray(np.concatenate(counts)),
               bucket_start=jnp.asarray(np.concatenate(starts).astype(np.int32)),
               bucket_offset=tuple(offsets), size=tuple(sizes),
               window=tuple(windows), order=int(t.order),
               num_ngrams=num_keys - 1)

  @property
  def nbytes(self) -> int:
    return int(self.keys.nbytes + self.counts.nbytes + self.bucket_start.nbytes)

  @property
  def bytes_per_ngram(self) -> float:
    return self.nbytes / max(self.num_ngrams, 1)

  def child(self, depth: int, node: jax.Array, token: jax.Array):
    """Child of `node` (a node of depth-1) with `token`.

    Args:
      depth: static depth of the child (1 = children of the root).
      node: int32 [...] node ids (-1 = absent); broadcast against `token`.
      token: int32 [...] token ids.

    Returns:
      (child int32 [...] node id or -1, count int32 [...] or 0).
    """
    node, token = jnp.broadcast_arrays(jnp.asarray(node, jnp.int32),
                                       jnp.asarray(token, jnp.int32))
    if depth > len(self.size):  # No n-grams this long.
      return (jnp.full(node.shape, -1, jnp.int32),
              jnp.zeros(node.shape, jnp.int32))
    window = self.window[depth - 1]
    bucket = (hash_pair(node, token, jnp) % jnp.uint32(self.size[depth - 1])).astype(
        jnp.int32)
    start = self.bucket_start[self.bucket_offset[depth - 1] + bucket]
    # Absent parents read a fixed (cached) window instead of a random one.
    start = jnp.where(node >= 0, start, 0)
    flat_start = start.reshape(-1)
    rows = jax.vmap(
        lambda s: lax.dynamic_slice(self.keys, (s, 0), (window, 2)))(flat_start)
    rows = rows.reshape(start.shape + (window, 2))
    match = ((rows[..., 0] == node[..., None])
             & (rows[..., 1] == token[..., None]) & (node >= 0)[..., None])
    slot = jnp.arange(window, dtype=jnp.int32)
    which = jnp.min(jnp.where(match, slot, window), axis=-1)
    found = which < window
    kid = jnp.where(found, start + which, -1)
    count = jnp.where(found, self.counts[jnp.maximum(kid, 0)], 0)
    return kid, count

  def suffix_nodes(self, window: jax.Array, window_len: jax.Array) -> jax.Array:
    """Nodes of the context suffixes, the state of `step`.

    Args:
      window: int32 [B, W] context tokens, right-aligned (newest last).
      window_len: int32 [B] real trailing entries of each row.

    Returns:
      int32 [B, order-1]: column m-1 is the node of the last m tokens (-1 if
      absent or m > window_len).
    """
    window = jnp.asarray(window, jnp.int32)
    window_len = jnp.asarray(window_len, jnp.int32)
    batch, w = window.shape
    columns = []
    for m in range(1, self.order):
      if m > w:
        columns.append(jnp.full((batch,), -1, jnp.int32))
        continue
      node = jnp.zeros((batch,), jnp.int32)
      for depth, i in enumerate(range(w - m, w), start=1):
        node, _ = self.child(depth, node, window[:, i])
      columns.append(jnp.where(window_len >= m, node, -1))
    if not columns:
      return jnp.zeros((batch, 0), jnp.int32)
    return jnp.stack(columns, axis=1)

  def step(self, nodes: jax.Array, tokens: jax.Array):
    """Probabilities of candidate tokens and the suffix nodes after each.

    Args:
      nodes: int32 [B, order-1] suffix nodes (see `suffix_nodes`).
      tokens: int32 [K] candidates shared by all rows, or [B, K].

    Returns:
      probs float32 [B, K], matched_len int32 [B, K] (bit-identical to
      `NGram.probability`), and next_nodes int32 [B, K, order-1]: the suffix
      nodes of context ++ [token].
    """
    nodes = jnp.asarray(nodes, jnp.int32)
    batch, width = nodes.shape
    tokens = jnp.asarray(tokens, jnp.int32)
    shared = tokens.ndim == 1
    tokens = jnp.broadcast_to(tokens, (batch, tokens.shape[-1]))
    probs = jnp.zeros(tokens.shape, jnp.float32)
    matched = jnp.zeros(tokens.shape, jnp.int32)
    if width == 0:
      return probs, matched, jnp.zeros(tokens.shape + (0,), jnp.int32)
    k = tokens.shape[1]
    root_child, _ = self.child(1, jnp.zeros(tokens.shape[1:] if shared
                                            else tokens.shape, jnp.int32),
                               tokens[0] if shared else tokens)
    root_child = jnp.broadcast_to(root_child, (batch, k))
    found = [self.child(m + 1, nodes[:, m - 1:m], tokens)
             for m in range(1, width + 1)]
    kids = jnp.stack([f[0] for f in found])  # [width, B, K]
    kid_counts = jnp.stack([f[1] for f in found]).astype(jnp.float32)
    # Context counts, as float32(count) * (1 / float32(context count)).
    parent_counts = self.counts[jnp.maximum(nodes, 0)].astype(jnp.float32)
    inverse = 1.0 / parent_counts  # [B, width]
    for m in range(width, 0, -1):  # Longest suffix first.
      kid, kid_count = kids[m - 1], kid_counts[m - 1]
      hit = (kid >= 0) & (matched == 0)
      p = jnp.where(kid_count == 0, 0.0, kid_count * inverse[:, m - 1:m])
      probs = jnp.where(hit, p, probs)
      matched = jnp.where(hit, m, matched)
    next_nodes = jnp.concatenate([root_child[None], kids[:width - 1]], axis=0)
    return probs, matched, jnp.moveaxis(next_nodes, 0, -1)

  def window_probability(self, window: jax.Array, window_len: jax.Array,
                         tokens: jax.Array):
    """(probs float32 [B, K], matched int32 [B, K]) for context windows."""
    probs, matched, _ = self.step(self.suffix_nodes(window, window_len), tokens)
    return probs, matched

  def probability(self, context: jax.Array, tokens: jax.Array,
                  context_len: jax.Array | None = None):
    """`window_probability` for one context int32 [C] and tokens [T]."""
    context = jnp.asarray(context, jnp.int32)
    if context_len is None:
      context_len = context.shape[0]
    probs, matched = self.window_probability(
        context[None], jnp.asarray(context_len, jnp.int32)[None], tokens)
    return probs[0], matched[0]
