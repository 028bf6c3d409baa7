"""Plain autoregressive decoding and the prefill every method shares.

``prefill`` is the one prompt pass of every decoder (plain, DART, DARTree), so a
prompt's cache and first token never depend on the method (what lets each
speculative method be lossless against ``ARDecoder``).
"""

import functools
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.sampling import KeySequence, SamplingConfig, sample


class Decoder(Protocol):
  """What ``generate`` needs from a decoding method."""

  scratch_rows: int  # cache rows a round writes past the committed length

  def start(self, tokens: jax.Array, prompt_lens: jax.Array, capacity: int,
            key: jax.Array, cache_rows: int | None = None) -> tuple[Any, jax.Array]:
    """Prefill right-padded ``tokens [B, Tp]``; returns (state, first tokens [B]).

    ``capacity``: the most cache rows the sequences will need. ``cache_rows``
    (default ``capacity``, at least ``Tp``): the rows the KV caches start with;
    ``generate`` grows them later (``transformer.grow_caches``).
    """

  def step(self, state: Any, active: jax.Array, attend_len: int
           ) -> tuple[Any, jax.Array, jax.Array]:
    """One round -> (state, new tokens [B, A], number of new tokens [B]) (device
    or host arrays)."""

  # Optional: ``keep_rows(state, slots: np.ndarray [B']) -> state`` keeps the
  # sequences in ``slots`` (repeats allowed) so that later rounds run a smaller
  # batch, with every kept sequence's tokens unchanged (``generate`` drops
  # finished sequences this way).


@flax.struct.dataclass
class ARState:
  """Plain decoding's state.

  cache: the target's cache; last: [B] each sequence's newest token (not in
  the cache yet); rows: [B] int32, the row of the call's batch each sequence
  is (its sampling draws; ``sampling.sample_log_probs``).
  """

  cache: KVCache
  last: jax.Array
  rows: jax.Array


class ARDecoder:
  """Plain autoregressive decoding: one target call per token."""

  scratch_rows = 1

  def __init__(self, target: Target, sampling: SamplingConfig, seed: int = 0):
    self.target = target
    self.sampling = sampling
    self.keys = KeySequence(seed)
    self.num_rows = 0  # the call's batch size, set by ``start``

  def start(self, tokens, prompt_lens, capacity, key=None, cache_rows=None):
    t = self.target
    self.num_rows = tokens.shape[0]
    cache = t.new_cache(self.num_rows, cache_rows or capacity)
    first, cache, _ = prefill(t.graphdef, t.call_params, cache, tokens, prompt_lens,
                              self.keys.next(), sampling=self.sampling, taps=(),
                              attn_impl=t.attn_impl)
    rows = t.place_batch(np.arange(self.num_rows, dtype=np.int32))
    return ARState(cache, first, rows), first

  def step(self, state, active, attend_len):
    t = self.target
    nxt, new_tokens, cache = _ar_step(
        t.graphdef, t.call_params, state.cache, state.last, active, self.keys.next(),
        state.rows, attend_len=attend_len, sampling=self.sampling,
        num_rows=self.num_rows, attn_impl=t.attn_impl)
    # One token each, known on the host: no device call for it.
    return ARState(cache, nxt, state.rows), new_tokens, np.ones(nxt.shape, np.int32)

  def keep_rows(self, state: ARState, slots: np.ndarray) -> ARState:
    """The state of sequences ``slots [B']`` only (one device)."""
    return _take_rows(state, jnp.asarray(slots, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "taps", "attn_impl"),
                   donate_argnames=("cache",))
def prefill(graphdef, params, cache, tokens, prompt_lens, key, *, sampling, taps,
            attn_impl):
  """Causal pass over right-padded prompts; samples each sequence's first token.

  tokens: [B, Tp]; prompt_lens: [B]. Returns (first [B], cache with lengths =
  prompt_lens, taps [B, Tp, n*H] or None).
  """
  batch, length = tokens.shape
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  col = jnp.arange(length)
  mask = (col[None, :] <= col[:, None])[None] & (col[None, None, :] < prompt_lens[:, None, None])
  out = model(tokens, positions, cache, mask, attend_len=1, taps=taps,
              logit_rows=(prompt_lens - 1)[:, None], attn_impl=attn_impl)
  first = sample(key, out.logits[:, 0], sampling)
  return first, out.cache.replace(lengths=prompt_lens.astype(jnp.int32)), out.taps


@functools.partial(jax.jit, static_argnames=("graphdef", "attend_len", "sampling",
                                             "num_rows", "attn_impl"),
                   donate_argnames=("cache",))
def _ar_step(graphdef, params, cache, last, active, key, rows, *, attend_len, sampling,
             num_rows, attn_impl):
  """Feeds ``last [B]`` at position ``lengths`` and samples the next token
  (``rows [B]`` of a batch of ``num_rows``: the draws each row gets).

  Returns (next [B], next as new tokens [B, 1], cache).
  """
  model = nnx.merge(graphdef, params)
  one = jnp.ones((last.shape[0], 1, 1), bool)
  out = model(last[:, None], cache.lengths[:, None], cache, one, attend_len=attend_len,
              attn_impl=attn_impl)
  cache = out.cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
  nxt = sample(key, out.logits[:, 0], sampling, rows, num_rows)
  return nxt, nxt[:, None], cache


@jax.jit
def _take_rows(state: ARState, slots: jax.Array) -> ARState:
  return ARState(state.cache.take_rows(slots), state.last[slots], state.rows[slots])
