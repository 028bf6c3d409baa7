"""DART speculative decoding: one compiled function per round.

Round (spec dart.md section 3): tree search over the draft logits of the last
round -> one target pass over ``[root] + tree`` with the tree mask -> sample-and-
match acceptance -> KV compaction -> the head drafts the next round from the taps
of the accepted path. The host only sees the emitted tokens.

The search phase is a parameter: DART's beam search with the N-gram term by
default, or a ``TreeBuilder`` (a static, hashable callable) that builds the
tree another way from the same draft levels, e.g. DART-GRU's corrected DARTree
trees (``dart_jax.draft.dart_gru``). Verify, accept and draft are shared.
"""

import functools
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.decode.ar import prefill
from dart_jax.draft.dart_head import DartHead
from dart_jax.errors import InputError
from dart_jax.models import layers
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.ngram.context import ContextNGram, ContextNGramConfig
from dart_jax.profiling import PhaseTimer, Wrap, no_wrap
from dart_jax.sampling import KeySequence, SamplingConfig
from dart_jax.tree import TreeConfig, dart_search
from dart_jax.verify import accept_tree


@flax.struct.dataclass
class DartState:
  """Device state between rounds.

  cache: target KV cache (committed tokens; the root is not in it).
  draft_cache: the head's one-layer cache of real positions (same lengths).
  history: [B, C] committed tokens with the root at index ``cache.lengths``.
  draft_logits: [B, D+1, Vd] the head's drafts for the next round.
  draft_hidden: [B, D+1, H] the hidden ``lm_head`` read for them, kept only
    when the tree builder needs it (else None).
  context: each sequence's ``ContextNGram`` of its committed tokens, when the
    search uses one (else None).
  """

  cache: KVCache
  draft_cache: KVCache
  history: jax.Array
  draft_logits: jax.Array
  draft_hidden: jax.Array | None = None
  context: ContextNGram | None = None


class TreeBuilder(Protocol):
  """A search phase replacing DART's beam search (a static jit argument: hashable).

  needs_hidden: whether it reads ``DartState.draft_hidden``.
  num_nodes: N, the draft nodes of every tree it builds (static).
  Called as ``builder(target_model, head, state)`` with the merged target and
  head modules; returns a batched ``Tree`` of depth <= D+1 (target ids).
  """

  needs_hidden: bool
  num_nodes: int

  def __call__(self, target_model, head, state: DartState): ...


def root_tokens(state: DartState) -> jax.Array:
  """The root of each sequence (the last emitted token): [B] int32."""
  return jnp.take_along_axis(state.history, state.cache.lengths[:, None], axis=1)[:, 0]


def context_window(history: jax.Array, root_pos: jax.Array, size: int
                   ) -> tuple[jax.Array, jax.Array]:
  """The last ``size`` tokens ending at the root.

  history: [B, C]; root_pos: [B]. Returns (window [B, size], real count [B]);
  entries before position 0 are padding at the front.
  """
  index = root_pos[:, None] - size + 1 + jnp.arange(size)[None, :]
  window = jnp.take_along_axis(history, jnp.maximum(index, 0), axis=1)
  return window, jnp.minimum(root_pos + 1, size).astype(jnp.int32)


def search_trees(draft_logits, history, root_pos, ngram, d2t, tree_config: TreeConfig,
                 context_size: int, context: ContextNGram | None = None):
  """Batched DART tree search (spec section 4) -> a batched ``Tree``; ``context``
  (one row per sequence) adds the context N-gram to the search."""
  window, window_len = context_window(history, root_pos, context_size)
  search = functools.partial(dart_search, config=tree_config)
  return jax.vmap(lambda lg, ctx, n, table: search(lg, ctx, ngram, d2t=d2t, context_len=n,
                                                   context_ngram=table))(
      draft_logits, window, window_len, context)


def _draft(target_model, head, taps, next_tokens, num_real, draft_cache, advance,
           attend_len, attn_impl, with_hidden=False):
  """Runs the head on new real positions; returns (logits, hidden or None,
  advanced cache)."""
  embeds = target_model.embed(next_tokens)
  hidden, draft_cache = head.levels(taps, embeds, num_real, draft_cache,
                                    attend_len=attend_len, attn_impl=attn_impl)
  return (head.logits(hidden), hidden if with_hidden else None,
          draft_cache.replace(lengths=draft_cache.lengths + advance))


@functools.partial(
    jax.jit, static_argnames=("target_graphdef", "head_graphdef", "sampling", "attn_impl",
                              "with_hidden", "context_config"),
    donate_argnames=("cache", "draft_cache"))
def dart_prefill(target_graphdef, target_params, head_graphdef, head_params, cache,
                 draft_cache, tokens, prompt_lens, key, *, sampling, attn_impl,
                 with_hidden=False, context_config: ContextNGramConfig | None = None):
  """Prefills target and head; returns (first tokens [B], DartState). With a
  ``context_config`` the state's context N-gram counts the prompt and first token."""
  head = nnx.merge(head_graphdef, head_params)
  c = head.config
  first, cache, taps = prefill(target_graphdef, target_params, cache, tokens, prompt_lens,
                               key, sampling=sampling, taps=c.tap_layers,
                               attn_impl=attn_impl)
  batch, length = tokens.shape
  col = jnp.arange(length)[None, :]
  # The head pairs the taps at position p with the token at p+1; the token after
  # the last prompt position is the root (the first generated token).
  shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], 1)
  next_tokens = jnp.where(col == (prompt_lens - 1)[:, None], first[:, None], shifted)
  target_model = nnx.merge(target_graphdef, target_params)
  draft_logits, draft_hidden, draft_cache = _draft(
      target_model, head, taps, next_tokens, prompt_lens, draft_cache, prompt_lens, 1,
      attn_impl, with_hidden)
  history_cap = cache.capacity + c.draft_length + 2
  history = jnp.zeros((batch, history_cap), jnp.int32)
  history = layers.write_rows(history, tokens, jnp.zeros((batch,), jnp.int32))
  history = layers.write_rows(history, first[:, None], prompt_lens)
  context = None
  if context_config is not None:
    context = ContextNGram.empty(batch, history_cap, context_config).add(
        history, jnp.ones((batch,), jnp.int32), prompt_lens, max_count=length)
  return first, DartState(cache, draft_cache, history, draft_logits, draft_hidden,
                          context)


def verify_trees(target_graphdef, target_params, cache, tree, *, attend_len, taps,
                 attn_impl):
  """Target pass over ``[root] + tree`` at positions ``length + depth`` (shared
  with DARTree): logits, taps and the cache with the tree rows written."""
  target_model = nnx.merge(target_graphdef, target_params)
  return target_model(tree.tokens, cache.lengths[:, None] + tree.depth, cache, tree.mask,
                      attend_len=attend_len, taps=taps, attn_impl=attn_impl)


def _accept(tree, out, history, context, active, key, *, sampling, max_depth):
  """Acceptance, KV compaction, history and context N-gram update ->
  (acceptance, cache, history, context, advance [B], taps of the accepted path
  [B, A, n*H])."""
  acc = accept_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, out.logits,
                    key, sampling, max_depth=max_depth)
  advance = acc.num_new * active.astype(jnp.int32)
  history = layers.write_rows(history, acc.new_tokens, out.cache.lengths + 1)
  if context is not None:
    context = context.add(history, out.cache.lengths + 1, advance,
                          max_count=acc.new_tokens.shape[1])
  cache = out.cache.compact(acc.path, advance)
  return acc, cache, history, context, advance, layers.gather_rows(out.taps, acc.path)


def _draft_next(target_graphdef, head_graphdef, target_params, head_params, acc, path_taps,
                draft_cache, advance, *, attend_len, attn_impl, with_hidden):
  """The head drafts the next round from the accepted path's taps."""
  target_model = nnx.merge(target_graphdef, target_params)
  head = nnx.merge(head_graphdef, head_params)
  return _draft(target_model, head, path_taps, acc.new_tokens, acc.num_new, draft_cache,
                advance, attend_len, attn_impl, with_hidden)


def _search(target_graphdef, head_graphdef, target_params, head_params, ngram, state, *,
            tree_config, context_size, builder):
  """The round's tree: DART's search, or ``builder``'s when one is given."""
  if builder is not None:
    return builder(nnx.merge(target_graphdef, target_params),
                   nnx.merge(head_graphdef, head_params), state)
  return search_trees(state.draft_logits, state.history, state.cache.lengths, ngram,
                      head_params["d2t"][...], tree_config, context_size, state.context)


def _round(target_graphdef, target_params, head_graphdef, head_params, ngram, state,
           active, key, *, tree_config, sampling, attend_len, attn_impl, context_size,
           builder: TreeBuilder | None = None, wrap: Wrap = no_wrap):
  """One DART round, phase by phase; ``wrap(name, fn)`` may wrap each phase (the
  profile mode jits and times them one by one). ``builder`` replaces DART's
  search (``tree_config``, ``context_size`` and ``ngram`` are then unused)."""
  head_config = nnx.merge(head_graphdef, head_params).config
  with_hidden = builder is not None and builder.needs_hidden
  search = functools.partial(_search, target_graphdef, head_graphdef,
                             tree_config=tree_config, context_size=context_size,
                             builder=builder)
  verify = functools.partial(verify_trees, target_graphdef, attend_len=attend_len,
                             taps=head_config.tap_layers, attn_impl=attn_impl)
  accept = functools.partial(_accept, sampling=sampling,
                             max_depth=head_config.draft_length + 1)
  draft = functools.partial(_draft_next, target_graphdef, head_graphdef,
                            attend_len=attend_len, attn_impl=attn_impl,
                            with_hidden=with_hidden)
  tree = wrap("search", search)(target_params, head_params, ngram, state)
  out = wrap("verify", verify)(target_params, state.cache, tree)
  acc, cache, history, context, advance, path_taps = wrap("accept", accept)(
      tree, out, state.history, state.context, active, key)
  draft_logits, draft_hidden, draft_cache = wrap("draft", draft)(
      target_params, head_params, acc, path_taps, state.draft_cache, advance)
  return (DartState(cache, draft_cache, history, draft_logits, draft_hidden, context),
          acc.new_tokens, acc.num_new)


dart_round = jax.jit(
    _round,
    static_argnames=("target_graphdef", "head_graphdef", "tree_config", "sampling",
                     "attend_len", "attn_impl", "context_size", "builder", "wrap"),
    donate_argnames=("state",))


class DartDecoder:
  """``generate``'s decoder for ``draft=DartHead`` (and DART-GRU drafters).

  builder: a ``TreeBuilder`` replacing DART's search (then ``ngram``, ``tree``
  and ``context_ngram`` must be unset); ``head`` may then be any drafter whose
  module runs like a DART head (``levels`` / ``logits``; DART-GRU's).
  context_ngram: True / a ``ContextNGramConfig`` to mix each sequence's own
    n-gram counts into the search's N-gram term (``dart_jax.ngram.context``),
    False for the reference search; None = ``DEFAULT_CONTEXT_NGRAM``.
  A ``"target"`` EOS in the tree config (the default) becomes the target's EOS.
  profile=True runs each round's phases (search, verify, accept, draft) as
  separately compiled calls and accumulates their seconds in ``phase_s``; the
  fused round is what normal decoding runs (slightly faster than the sum).
  """

  def __init__(self, target: Target, head: DartHead, *, sampling: SamplingConfig,
               seed: int = 0, ngram=None, tree: TreeConfig | None = None,
               profile: bool = False, builder: TreeBuilder | None = None,
               context_ngram: bool | ContextNGramConfig | None = None):
    head.check_target(target)
    self.target, self.head = target, head
    self.sampling = sampling
    self.builder = builder
    if builder is not None and (ngram is not None or tree is not None
                                or context_ngram):
      raise InputError("this drafter builds its own trees: drop ngram=... / "
                       "context_ngram=... and pass its tree options instead")
    self.tree_config = None if builder is not None else (
        (tree or TreeConfig()).with_target_eos(target_eos_id(target)))
    self.context_config = (None if builder is not None
                           else resolve_context_ngram(context_ngram))
    self.table = _as_table(ngram)
    order = getattr(self.table, "order", 2) if self.table is not None else 2
    context_width = self.context_config.width if self.context_config else 0
    self.context_size = max(order - 1, context_width, 1)
    self.scratch_rows = (builder.num_nodes if builder is not None
                         else self.tree_config.remain_total) + 1
    self.with_hidden = builder is not None and builder.needs_hidden
    self.keys = KeySequence(seed)
    self.profile = profile
    self.timer = PhaseTimer()
    self.phase_s = self.timer.seconds  # filled in profile mode

  def start(self, tokens, prompt_lens, capacity, key=None):
    t, h = self.target, self.head
    d = h.config.draft_length
    if capacity < tokens.shape[1] + d:
      raise InputError(f"draft length D={d} does not fit a cache of {capacity} rows; "
                       "raise max_length or use a smaller D")
    batch = tokens.shape[0]
    cache = t.new_cache(batch, capacity)
    # The head writes up to D+2 real rows and D mask rows past the committed length.
    draft_cache = KVCache.for_attention(1, batch, capacity + 2 * d + 2,
                                        h.config.num_kv_heads, h.config.head_dim,
                                        t.dtype, t.attn_impl)
    first, state = dart_prefill(
        t.graphdef, t.params, h.graphdef, h.params, cache, draft_cache, tokens,
        prompt_lens, self.keys.next(), sampling=self.sampling, attn_impl=t.attn_impl,
        with_hidden=self.with_hidden, context_config=self.context_config)
    return state, first

  def step(self, state, active, attend_len):
    t, h = self.target, self.head
    static = dict(tree_config=self.tree_config, sampling=self.sampling,
                  attend_len=attend_len, attn_impl=t.attn_impl,
                  context_size=self.context_size, builder=self.builder)
    args = (t.graphdef, t.params, h.graphdef, h.params, self.table, state, active,
            self.keys.next())
    if not self.profile:
      return dart_round(*args, **static)
    wrap = self.timer.wrap(_round, t.graphdef, h.graphdef, *sorted(static.items()))
    return _round(*args, **static, wrap=wrap)


DEFAULT_CONTEXT_NGRAM = ContextNGramConfig()


def resolve_context_ngram(value: bool | ContextNGramConfig | None
                          ) -> ContextNGramConfig | None:
  """The context N-gram config a ``context_ngram=`` argument asks for."""
  if value is None:
    return DEFAULT_CONTEXT_NGRAM
  if isinstance(value, ContextNGramConfig):
    return value
  if isinstance(value, bool):
    return ContextNGramConfig() if value else None
  raise InputError(f"context_ngram must be True, False or a ContextNGramConfig, got "
                   f"{value!r}")


def target_eos_id(target: Target) -> int | None:
  """The EOS id the reference search ranks last: the tokenizer's (first) EOS, else
  the model config's; None when the target has none."""
  tokenizer = getattr(target, "tokenizer", None)
  ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ()) or tuple(
      target.config.eos_token_ids)
  return int(ids[0]) if ids else None


def _as_table(ngram):
  """Accepts an ``NGram`` (converted once) or a device table."""
  if ngram is None:
    return None
  to_table = getattr(ngram, "to_table", None)
  return to_table() if to_table is not None else ngram
