"""DART speculative decoding: one compiled function per round.

Round (spec dart.md section 3): tree search over the draft logits of the last
round -> one target pass over ``[root] + tree`` with the tree mask -> sample-and-
match acceptance -> KV compaction -> the head drafts the next round from the taps
of the accepted path. The host only sees the emitted tokens.
"""

import functools
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.draft.dart_head import DartHead
from dart_jax.errors import InputError
from dart_jax.generate import prefill
from dart_jax.models import layers
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import TreeConfig, dart_search
from dart_jax.verify import accept_tree


@flax.struct.dataclass
class DartState:
  """Device state between rounds.

  cache: target KV cache (committed tokens; the root is not in it).
  draft_cache: the head's one-layer cache of real positions (same lengths).
  history: [B, C] committed tokens with the root at index ``cache.lengths``.
  draft_logits: [B, D+1, Vd] the head's drafts for the next round.
  """

  cache: KVCache
  draft_cache: KVCache
  history: jax.Array
  draft_logits: jax.Array


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
                 context_size: int):
  """Batched DART tree search (spec section 4) -> a batched ``Tree``."""
  window, window_len = context_window(history, root_pos, context_size)
  search = functools.partial(dart_search, config=tree_config)
  return jax.vmap(lambda lg, ctx, n: search(lg, ctx, ngram, d2t=d2t, context_len=n))(
      draft_logits, window, window_len)


def _draft(target_model, head, taps, next_tokens, num_real, draft_cache, advance,
           attend_len, attn_impl):
  """Runs the head on new real positions; returns (logits, advanced cache)."""
  embeds = target_model.embed(next_tokens)
  logits, draft_cache = head(taps, embeds, num_real, draft_cache, attend_len=attend_len,
                             attn_impl=attn_impl)
  return logits, draft_cache.replace(lengths=draft_cache.lengths + advance)


@functools.partial(
    jax.jit, static_argnames=("target_graphdef", "head_graphdef", "sampling", "attn_impl"),
    donate_argnames=("cache", "draft_cache"))
def dart_prefill(target_graphdef, target_params, head_graphdef, head_params, cache,
                 draft_cache, tokens, prompt_lens, key, *, sampling, attn_impl):
  """Prefills target and head; returns (first tokens [B], DartState)."""
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
  draft_logits, draft_cache = _draft(target_model, head, taps, next_tokens, prompt_lens,
                                     draft_cache, prompt_lens, 1, attn_impl)
  history_cap = cache.capacity + c.draft_length + 2
  history = jnp.zeros((batch, history_cap), jnp.int32)
  history = layers.write_rows(history, tokens, jnp.zeros((batch,), jnp.int32))
  history = layers.write_rows(history, first[:, None], prompt_lens)
  return first, DartState(cache, draft_cache, history, draft_logits)


@functools.partial(
    jax.jit,
    static_argnames=("target_graphdef", "head_graphdef", "tree_config", "sampling",
                     "attend_len", "attn_impl", "context_size"),
    donate_argnames=("state",))
def dart_round(target_graphdef, target_params, head_graphdef, head_params, ngram, state,
               active, key, *, tree_config, sampling, attend_len, attn_impl, context_size):
  """One DART round -> (state, new tokens [B, D+2], number of new tokens [B])."""
  target_model = nnx.merge(target_graphdef, target_params)
  head = nnx.merge(head_graphdef, head_params)
  c = head.config
  lengths = state.cache.lengths
  tree = search_trees(state.draft_logits, state.history, lengths, ngram, head.d2t[...],
                      tree_config, context_size)
  out = target_model(tree.tokens, lengths[:, None] + tree.depth, state.cache, tree.mask,
                     attend_len=attend_len, taps=c.tap_layers)
  acc = accept_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, out.logits,
                    key, sampling, max_depth=c.draft_length + 1)
  advance = acc.num_new * active.astype(jnp.int32)
  cache = out.cache.compact(acc.path, advance)
  history = layers.write_rows(state.history, acc.new_tokens, lengths + 1)
  path_taps = layers.gather_rows(out.taps, acc.path)
  draft_logits, draft_cache = _draft(target_model, head, path_taps, acc.new_tokens,
                                     acc.num_new, state.draft_cache, advance, attend_len,
                                     attn_impl)
  return DartState(cache, draft_cache, history, draft_logits), acc.new_tokens, acc.num_new


class DartDecoder:
  """``generate``'s decoder for ``draft=DartHead``."""

  def __init__(self, target: Target, head: DartHead, *, sampling: SamplingConfig,
               seed: int = 0, ngram=None, tree: TreeConfig | None = None):
    head.check_target(target)
    self.target, self.head = target, head
    self.sampling = sampling
    self.tree_config = tree or TreeConfig()
    self.table = _as_table(ngram)
    order = getattr(self.table, "order", 2) if self.table is not None else 2
    self.context_size = max(order - 1, 1)
    self.scratch_rows = self.tree_config.remain_total + 1
    self.key = jax.random.PRNGKey(seed)

  def _next_key(self):
    self.key, sub = jax.random.split(self.key)
    return sub

  def start(self, tokens, prompt_lens, capacity, key=None):
    t, h = self.target, self.head
    d = h.config.draft_length
    if capacity < tokens.shape[1] + d:
      raise InputError(f"draft length D={d} does not fit a cache of {capacity} rows; "
                       "raise max_length or use a smaller D")
    batch = tokens.shape[0]
    cache = t.new_cache(batch, capacity)
    # The head writes up to D+2 real rows and D mask rows past the committed length.
    draft_cache = KVCache.create(1, batch, capacity + 2 * d + 2, h.config.num_kv_heads,
                                 h.config.head_dim, t.dtype)
    return dart_prefill(
        t.graphdef, t.params, h.graphdef, h.params, cache, draft_cache, tokens,
        prompt_lens, self._next_key(), sampling=self.sampling, attn_impl=t.attn_impl)[::-1]

  def step(self, state, active, attend_len):
    t, h = self.target, self.head
    return dart_round(
        t.graphdef, t.params, h.graphdef, h.params, self.table, state, active,
        self._next_key(), tree_config=self.tree_config, sampling=self.sampling,
        attend_len=attend_len, attn_impl=t.attn_impl, context_size=self.context_size)


def _as_table(ngram):
  """Accepts an ``NGram`` (converted once) or a device table."""
  if ngram is None:
    return None
  to_table = getattr(ngram, "to_table", None)
  return to_table() if to_table is not None else ngram
