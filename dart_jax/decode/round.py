"""The speculative round every method runs, and the ``Proposer`` it is written against.

A round (``docs/algorithms.md``, "The round"), one compiled function:

  propose  the proposer builds a draft tree from its state (``Tree``, target ids);
  verify   one target pass over ``[root] + tree`` with the ancestor mask,
           tapping the target layers the proposer reads;
  accept   sample-and-match acceptance, history update, KV compaction;
  update   the proposer takes in the accepted path (its taps and tokens) and
           drafts what the next round's tree is built from.

The phases are named "search", "verify", "accept" and "draft" in the profile
mode (``profile=True``), which compiles and times each phase on its own.

Adding a method is a proposer (a hashable, frozen object: it is a static jit
argument, so it holds graphdefs and configs, never arrays) plus one entry in
``dart_jax.decode.methods``. What it must provide is ``Proposer`` below; DART
(``decode.dart``) and DARTree (``decode.dartree``) are the two examples.
"""

import functools
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.decode.ar import prefill
from dart_jax.decode.verify import Acceptance, accept_and_compact, verify_trees
from dart_jax.models import layers
from dart_jax.models.static_graph import FlatTree
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.profiling import PhaseTimer, Wrap, no_wrap
from dart_jax.sampling import KeySequence, SamplingConfig
from dart_jax.tree import Tree


@flax.struct.dataclass
class RoundState:
  """Device state between rounds.

  cache: the target's KV cache of committed tokens (the root is not in it).
  history: [B, C] committed tokens with the root (the last emitted token) at
    index ``cache.lengths``.
  draft: the proposer's own state (a pytree: its cache, next round's drafts).
  """

  cache: KVCache
  history: jax.Array
  draft: Any


def root_tokens(state: RoundState) -> jax.Array:
  """The root of each sequence (the last emitted token): [B] int32."""
  return jnp.take_along_axis(state.history, state.cache.lengths[:, None], axis=1)[:, 0]


class Proposer(Protocol):
  """A draft method, as the round sees it (hashable; static under jit).

  taps: target layers whose inputs the verify pass returns (``Output.taps``).
  num_nodes: N, the draft nodes of every tree it proposes (static).
  max_depth: the deepest node of its trees (acceptance walks this many levels).
  ``draft_params`` below is the pytree of arrays the decoder passes every
  round (drafter parameters, tables); it is never donated.
  """

  taps: tuple[int, ...]
  num_nodes: int
  max_depth: int

  def check_fits(self, capacity: int, prompt_len: int) -> None:
    """Raises ``InputError`` when a cache of ``capacity`` rows cannot hold it."""

  def new_draft_cache(self, batch: int, capacity: int, dtype, attn_impl: str,
                      mesh: jax.sharding.Mesh | None = None) -> Any:
    """The proposer's cache(s) for ``batch`` sequences, on ``mesh`` (the
    target's) when given: rows over "data", the drafter's heads replicated."""

  def start(self, target_model, draft_params, draft_cache, taps: jax.Array,
            tokens: jax.Array, prompt_lens: jax.Array, first: jax.Array,
            history: jax.Array, attn_impl: str) -> Any:
    """Its state after the prompt: taps [B, Tp, n*H] of the prompt, tokens
    [B, Tp] (right-padded), first [B] the first generated token (the root)."""

  def propose(self, target_model, draft_params, state: RoundState) -> Tree:
    """This round's batched tree (target ids, depth <= ``max_depth``)."""

  def update(self, target_model, draft_params, draft: Any, acc: Acceptance,
             path_taps: jax.Array, advance: jax.Array, history: jax.Array, *,
             attend_len: int, attn_impl: str) -> Any:
    """Its state for the next round from the accepted path: path_taps
    [B, A, n*H] (root first), advance [B] committed tokens per row, history
    already holding the emitted tokens."""


@functools.partial(jax.jit, static_argnames=("target_graphdef", "proposer", "sampling",
                                             "attn_impl", "capacity"),
                   donate_argnames=("cache", "draft_cache"))
def speculative_prefill(target_graphdef, target_params, draft_params, cache, draft_cache,
                        tokens, prompt_lens, key, *, proposer: Proposer,
                        sampling: SamplingConfig, attn_impl: str, capacity: int):
  """The shared prefill plus the proposer's start -> (first tokens [B], RoundState).

  capacity: the most target cache rows the sequences will need (the history's
  length follows it; the caches may start smaller and grow).
  """
  first, cache, taps = prefill(target_graphdef, target_params, cache, tokens, prompt_lens,
                               key, sampling=sampling, taps=proposer.taps,
                               attn_impl=attn_impl)
  batch = tokens.shape[0]
  # Acceptance writes up to max_depth + 1 tokens after the root.
  history = jnp.zeros((batch, capacity + proposer.max_depth + 1), jnp.int32)
  history = layers.write_rows(history, tokens, jnp.zeros((batch,), jnp.int32))
  history = layers.write_rows(history, first[:, None], prompt_lens)
  target_model = nnx.merge(target_graphdef, target_params)
  draft = proposer.start(target_model, draft_params, draft_cache, taps, tokens, prompt_lens,
                         first, history, attn_impl)
  return first, RoundState(cache, history, draft)


def _propose(target_graphdef, target_params, draft_params, state, *, proposer):
  return proposer.propose(nnx.merge(target_graphdef, target_params), draft_params, state)


def _update(target_graphdef, target_params, draft_params, draft, acc, path_taps, advance,
            history, *, proposer, attend_len, attn_impl):
  return proposer.update(nnx.merge(target_graphdef, target_params), draft_params, draft,
                         acc, path_taps, advance, history, attend_len=attend_len,
                         attn_impl=attn_impl)


def _round(target_graphdef, target_params, draft_params, state: RoundState, active, key, *,
           proposer: Proposer, sampling: SamplingConfig, attend_len: int, attn_impl: str,
           wrap: Wrap = no_wrap):
  """One round, phase by phase; ``wrap(name, fn)`` may wrap each phase (the
  profile mode compiles and times them one by one).

  active: [B] rows still decoding. Returns (state, new tokens [B, A], number of
  new tokens [B]).
  """
  propose = functools.partial(_propose, target_graphdef, proposer=proposer)
  verify = functools.partial(verify_trees, target_graphdef, attend_len=attend_len,
                             taps=proposer.taps, attn_impl=attn_impl)
  accept = functools.partial(accept_and_compact, sampling=sampling,
                             max_depth=proposer.max_depth)
  update = functools.partial(_update, target_graphdef, proposer=proposer,
                             attend_len=attend_len, attn_impl=attn_impl)
  tree = wrap("search", propose)(target_params, draft_params, state)
  out = wrap("verify", verify)(target_params, state.cache, tree)
  acc, cache, history, advance, path_taps = wrap("accept", accept)(
      tree, out, state.history, active, key)
  draft = wrap("draft", update)(target_params, draft_params, state.draft, acc, path_taps,
                                advance, history)
  return RoundState(cache, history, draft), acc.new_tokens, acc.num_new


speculative_round = jax.jit(
    _round, static_argnames=("target_graphdef", "proposer", "sampling", "attend_len",
                             "attn_impl", "wrap"),
    donate_argnames=("state",))


class SpeculativeDecoder:
  """``generate``'s decoder for every speculative method: a proposer in the round.

  Args:
    target: the target model.
    proposer: the method (``Proposer``).
    draft_params: the arrays its phases read (drafter parameters, tables).
    sampling: target sampling configuration.
    seed: RNG seed.
    profile: run each round's phases (search, verify, accept, draft) as
      separately compiled calls and accumulate their seconds in ``phase_s``;
      the fused round is what normal decoding runs (slightly faster than the sum).
  """

  def __init__(self, target: Target, proposer: Proposer, draft_params: Any, *,
               sampling: SamplingConfig, seed: int = 0, profile: bool = False):
    self.target, self.proposer, self.draft_params = target, proposer, draft_params
    self.call_draft_params = FlatTree(draft_params)  # flattened once
    self.sampling = sampling
    self.scratch_rows = proposer.num_nodes + 1  # the root and the tree
    self.keys = KeySequence(seed)
    self.profile = profile
    self.timer = PhaseTimer()
    self.phase_s = self.timer.seconds  # filled in profile mode

  def start(self, tokens, prompt_lens, capacity, key=None, cache_rows=None):
    t, p = self.target, self.proposer
    p.check_fits(capacity, tokens.shape[1])
    batch, rows = tokens.shape[0], cache_rows or capacity
    first, state = speculative_prefill(
        t.graphdef, t.call_params, self.call_draft_params, t.new_cache(batch, rows),
        p.new_draft_cache(batch, rows, t.dtype, t.attn_impl, t.mesh), tokens, prompt_lens,
        self.keys.next(), proposer=p, sampling=self.sampling, attn_impl=t.attn_impl,
        capacity=capacity)
    return state, first

  def step(self, state, active, attend_len):
    t = self.target
    static = dict(proposer=self.proposer, sampling=self.sampling, attend_len=attend_len,
                  attn_impl=t.attn_impl)
    args = (t.graphdef, t.call_params, self.call_draft_params, state, active, self.keys.next())
    if not self.profile:
      return speculative_round(*args, **static)
    wrap = self.timer.wrap(_round, t.graphdef, *sorted(static.items()))
    return _round(*args, **static, wrap=wrap)
