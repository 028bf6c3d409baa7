"""`ContextNGram`: each sequence's own n-gram counts, on device, for the tree search.

The corpus N-gram (`NGramTable`) knows the language but never sees the prompt. This
table counts the n-grams of each sequence's prompt and generated tokens, so the tree
search can favour continuations the context has already shown: an answer repeating
its function signature, a name from an earlier turn, a quoted passage being rewritten.

Layout: one open-addressing hash table per batch row, ``capacity`` slots (a power of
two), probed linearly over a static window of ``probes`` slots. An entry counts one
(context, next) pair, context = the m tokens before ``next`` (1 <= m <= max_order-1);
its key is a 32-bit hash of (context, next). Two more entries per context: ``next`` =
``TOTAL`` counts the context's occurrences followed by any token, and ``next`` =
``LAST`` holds (plus one) the token that followed its latest occurrence, the
prediction a prompt-lookup drafter would copy. Keys are hashes:
two n-grams share a key with probability ~2^-32 per pair, which can only change a
draft score, never the output (the target verifies every drafted token).

Inserts run as ``probes`` vectorised claim rounds over deduplicated keys (no host loop,
no sequential scan): a key either finds itself, wins an empty slot (the largest key
wins a contested slot), or moves one slot on. Nothing is ever deleted, so a probe
sequence meets a stored key before any empty slot and lookups read one window.
A key that finds no slot within its window is dropped; the capacity keeps the load
at most 0.5, so that is vanishingly rare and again only affects draft scores.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from dart_jax.errors import ConfigError
from dart_jax.models import precision
from dart_jax.ngram.table import hash_pair
from kernels import cpu_matmul

TOTAL = -1  # the ``next`` token of a context's total-count entry
LAST = -2  # the ``next`` token of a context's latest-continuation entry
_SEED = np.uint32(0x2545F491)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ContextNGramConfig:
  """How the context table is counted and used by the tree search.

  The defaults are the rule measured best on development prompts (train.prompts
  families, never benchmark prompts; see docs/context_ngram.md): 4-grams, matches of
  at least a two-token context, the copy prediction injected with draft weight 0.5.

  Attributes:
    max_order: longest n-gram counted (contexts of 1..max_order-1 tokens).
    min_order: shortest n-gram whose match is used (2 = a one-token context).
    weight: where the context matches (the longest stored context followed by the
      candidate has at least ``min_order``-1 tokens), the N-gram probability is
      ``weight * P_context + (1 - weight) * P_corpus``; elsewhere ``P_corpus``.
    draft_weight: the draft probability of a candidate becomes
      ``max(p_draft, draft_weight * P_context)`` (all levels); 0 = unchanged.
    inject: each beam member also expands the context's copy prediction (the
      token after the latest occurrence of its longest matching context), when it
      is not among the level's top-k; its draft probability is 0 (the reference's
      p_draft covers the top-k only), so it needs ``draft_weight`` > 0 to compete.
    probes: slots a lookup reads (the probe window).
  """
  max_order: int = 4
  min_order: int = 3
  weight: float = 1.0
  draft_weight: float = 0.5
  inject: bool = True
  probes: int = 16

  def __post_init__(self):
    if not isinstance(self.max_order, int) or self.max_order < 2:
      raise ConfigError(f"ContextNGramConfig.max_order must be an int >= 2, got "
                        f"{self.max_order!r}.")
    if not isinstance(self.min_order, int) or not 2 <= self.min_order <= self.max_order:
      raise ConfigError(f"ContextNGramConfig.min_order must be in [2, max_order="
                        f"{self.max_order}], got {self.min_order!r}.")
    for name in ("weight", "draft_weight"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ConfigError(f"ContextNGramConfig.{name} must be in [0, 1], got "
                          f"{getattr(self, name)!r}.")
    if not isinstance(self.probes, int) or self.probes < 1:
      raise ConfigError(f"ContextNGramConfig.probes must be an int >= 1, got "
                        f"{self.probes!r}.")

  @property
  def width(self) -> int:
    """Context tokens a lookup reads: max_order - 1."""
    return self.max_order - 1

  def capacity(self, max_tokens: int) -> int:
    """Slots per row for sequences of up to ``max_tokens`` tokens (load <= 0.5)."""
    entries = 3 * self.width * max(int(max_tokens), 1)
    return 1 << (2 * entries - 1).bit_length()


def suffix_hashes(tokens: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Hashes of the suffixes of token windows, newest token first.

  Args:
    tokens: int32 [..., W] windows (newest last).
    valid: bool [..., W] which entries are real tokens.

  Returns:
    (hashes uint32 [..., W], ok bool [..., W]): column m-1 hashes the last m tokens;
    ok where all of them are real.
  """
  hashes, oks = [], []
  h = jnp.full(tokens.shape[:-1], _SEED, jnp.uint32)
  ok = jnp.ones(tokens.shape[:-1], bool)
  for i in range(tokens.shape[-1] - 1, -1, -1):
    h = hash_pair(h, tokens[..., i], jnp)
    ok = ok & valid[..., i]
    hashes.append(h)
    oks.append(ok)
  return jnp.stack(hashes, -1), jnp.stack(oks, -1)


def entry_key(context_hash: jax.Array, next_token) -> jax.Array:
  """Key of the entry (context, next): uint32, never 0 (0 marks an empty slot)."""
  key = hash_pair(context_hash, jnp.asarray(next_token, jnp.int32), jnp)
  return jnp.where(key == 0, jnp.uint32(1), key)


@struct.dataclass
class ContextNGram:
  """Per-row context n-gram tables (a pytree; one row per sequence, or one row).

  Attributes:
    keys: uint32 [B, S] (or [S] for one row) entry keys, 0 = empty.
    values: int32 [B, S] (or [S]) entry counts (``LAST`` entries: token + 1).
    config: the static `ContextNGramConfig`.
  """
  keys: jax.Array
  values: jax.Array
  config: ContextNGramConfig = struct.field(pytree_node=False)

  @classmethod
  def empty(cls, batch: int, max_tokens: int,
            config: ContextNGramConfig) -> "ContextNGram":
    """Empty tables for ``batch`` sequences of up to ``max_tokens`` tokens."""
    size = config.capacity(max_tokens)
    return cls(jnp.zeros((batch, size), jnp.uint32), jnp.zeros((batch, size), jnp.int32),
               config)

  def add(self, history: jax.Array, start: jax.Array, count: jax.Array,
          max_count: int) -> "ContextNGram":
    """Counts, per row, the n-grams whose last token is at positions
    ``start .. start + count - 1`` of ``history``.

    Args:
      history: int32 [B, C] tokens of each sequence.
      start: int32 [B] first new position (>= 1).
      count: int32 [B] new positions (0..max_count).
      max_count: static bound on ``count``.
    """
    width = self.config.width
    offsets = jnp.arange(max_count, dtype=jnp.int32)
    positions = start[:, None] + offsets[None, :]  # [B, A]
    # context tokens of each new position, oldest first: [B, A, W]
    back = positions[..., None] - width + jnp.arange(width, dtype=jnp.int32)
    context = jnp.take_along_axis(history, jnp.maximum(back, 0).reshape(
        back.shape[0], -1), axis=1).reshape(back.shape)
    nxt = jnp.take_along_axis(history, jnp.minimum(positions, history.shape[1] - 1),
                              axis=1)
    hashes, ok = suffix_hashes(context, back >= 0)
    ok = (ok & (offsets < count[:, None])[..., None]).reshape(history.shape[0], -1)
    count_keys = jnp.concatenate([entry_key(hashes, nxt[..., None]).reshape(ok.shape),
                                  entry_key(hashes, TOTAL).reshape(ok.shape)], axis=1)
    last_keys = entry_key(hashes, LAST).reshape(ok.shape)
    last_values = jnp.broadcast_to(nxt[..., None] + 1, hashes.shape).reshape(ok.shape)
    probes = self.config.probes

    keys, values = _insert_rows(self.keys, self.values, count_keys,
                                jnp.ones_like(count_keys, jnp.int32),
                                jnp.concatenate([ok, ok], axis=1), probes, add=True)
    keys, values = _insert_rows(keys, values, last_keys, last_values, ok, probes, add=False)
    return self.replace(keys=keys, values=values)

  def lookup(self, query: jax.Array) -> jax.Array:
    """Counts of entry keys ``query`` uint32 [...] in a single-row table."""
    mask = jnp.uint32(self.keys.shape[-1] - 1)
    slots = ((query[..., None] + jnp.arange(self.config.probes, dtype=jnp.uint32))
             & mask).astype(jnp.int32)
    stored = self.keys[slots]
    return jnp.sum(jnp.where(stored == query[..., None], self.values[slots], 0), -1)

  def predict(self, context_tokens: jax.Array, context_valid: jax.Array) -> jax.Array:
    """The copy prediction of each context (single-row table): the token after the
    latest occurrence of its longest stored suffix of >= min_order-1 tokens.

    context_tokens, context_valid: [M, W] as in `probability`. Returns int32 [M]
    (-1 where no suffix was seen).
    """
    hashes, ok = suffix_hashes(context_tokens, context_valid)
    last = self.lookup(entry_key(hashes, LAST))  # [M, W], token + 1 or 0
    token = jnp.full(hashes.shape[:1], -1, jnp.int32)
    for m in range(self.config.min_order - 1, self.config.width + 1):  # longest wins
      token = jnp.where(ok[:, m - 1] & (last[:, m - 1] > 0), last[:, m - 1] - 1, token)
    return token

  def probability(self, context_tokens: jax.Array, context_valid: jax.Array,
                  tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Context probabilities of candidates, single-row table.

    Args:
      context_tokens: int32 [M, W] the last W tokens of each beam member's context.
      context_valid: bool [M, W] which of them are real.
      tokens: int32 [k] candidates (shared) or [M, k].

    Returns:
      (probs float32 [M, k], matched int32 [M, k]): the maximum-likelihood estimate
      count(context_m, t) / count(context_m) for the longest m >= min_order-1 whose
      n-gram with t is stored; 0 and matched 0 where none is.
    """
    hashes, ok = suffix_hashes(context_tokens, context_valid)  # [M, W]
    tokens = jnp.broadcast_to(tokens, hashes.shape[:1] + tokens.shape[-1:])
    num = self.lookup(entry_key(hashes[:, None, :], tokens[..., None]))  # [M, k, W]
    total = self.lookup(entry_key(hashes, TOTAL)).astype(jnp.float32)  # [M, W]
    probs = jnp.zeros(tokens.shape, jnp.float32)
    matched = jnp.zeros(tokens.shape, jnp.int32)
    for m in range(self.config.width, self.config.min_order - 2, -1):
      hit = ok[:, None, m - 1] & (num[..., m - 1] > 0) & (matched == 0)
      p = num[..., m - 1].astype(jnp.float32) / jnp.maximum(total[:, None, m - 1], 1.0)
      probs = jnp.where(hit, p, probs)
      matched = jnp.where(hit, m + 1, matched)
    return probs, matched

  def mix(self, p_corpus: jax.Array, p_context: jax.Array,
          matched: jax.Array) -> jax.Array:
    """The search's N-gram probability from the corpus and context estimates."""
    w = np.float32(self.config.weight)
    return jnp.where(matched > 0, w * p_context + (1 - w) * p_corpus, p_corpus)


def _insert_rows(keys, values, new_keys, new_values, valid, probes: int, add: bool):
  """`_insert_row` for each row of [B, ...] arrays: one FFI call where the CPU
  kernels run (the same claim rounds, bit-identical tables; XLA:CPU's sort,
  sums and while loop took ~0.4 ms a DART round on the 2-core Zen 3), else a
  vmap."""
  if precision.cpu_kernel_active():
    return cpu_matmul.context_insert(keys, values, new_keys, new_values, valid,
                                     probes=probes, add=add)
  return jax.vmap(lambda *row: _insert_row(*row, probes=probes, add=add))(
      keys, values, new_keys, new_values, valid)


def _insert_row(keys, values, new_keys, new_values, valid, probes: int, add: bool):
  """Writes the valid entries ``new_keys`` [n] into one row: ``add`` adds their
  ``new_values`` to the stored values; otherwise the latest (highest index) entry
  of each key sets its value."""
  n = new_keys.shape[0]
  order = jnp.argsort(jnp.where(valid, new_keys, jnp.uint32(0)), stable=True)
  ordered = jnp.where(valid, new_keys, jnp.uint32(0))[order]
  ordered_values = new_values[order]
  index = jnp.arange(n, dtype=jnp.int32)
  is_head = (ordered != 0) & ((index == 0) | (ordered != jnp.roll(ordered, 1)))
  # Each distinct key's run is index .. next head - 1 (in input order: stable sort).
  head_index = jnp.where(is_head, index, n)
  next_head = jnp.concatenate([lax.cummin(head_index, reverse=True)[1:],
                               jnp.array([n], jnp.int32)])
  if add:
    run_sum = jnp.cumsum(ordered_values)
    before = jnp.concatenate([jnp.zeros((1,), run_sum.dtype), run_sum])
    value = before[next_head] - before[index]
  else:
    value = ordered_values[jnp.maximum(next_head - 1, 0)]
  mask = jnp.uint32(keys.shape[0] - 1)

  def claim_round(carry):
    probe, keys, placed, slot_of = carry
    slot = ((ordered + probe.astype(jnp.uint32)) & mask).astype(jnp.int32)
    current = keys[slot]
    found = ~placed & (current == ordered)
    empty = ~placed & (current == 0)
    keys = keys.at[slot].max(jnp.where(empty, ordered, jnp.uint32(0)))
    won = empty & (keys[slot] == ordered)
    return probe + 1, keys, placed | found | won, jnp.where(found | won, slot, slot_of)

  def unplaced(carry):
    probe, _, placed, _ = carry
    return (probe < probes) & ~jnp.all(placed)

  # A loop, not ``probes`` unrolled copies: each round's gathers and scatter are
  # compiled once (unrolled, they tripled the compile time of a DART round on CPU).
  # It stops once every key is placed (a round then changes nothing): in a sparse
  # table that is after a round or two, not all ``probes``.
  _, keys, placed, slot_of = lax.while_loop(
      unplaced, claim_round,
      (jnp.int32(0), keys, ~is_head, jnp.zeros((n,), jnp.int32)))
  write = placed & is_head
  if add:
    return keys, values.at[slot_of].add(jnp.where(write, value, 0))
  # Slots of non-written entries are redirected past the end and dropped.
  return keys, values.at[jnp.where(write, slot_of, keys.shape[0])].set(value, mode="drop")
