"""DART speculative decoding: one compiled function per round.

Round (spec dart.md section 3): tree search over the draft logits of the last
round -> one target pass over ``[root] + tree`` with the tree mask -> sample-and-
match acceptance -> KV compaction -> the head drafts the next round from the taps
of the accepted path. The host only sees the emitted tokens.
"""

import functools
import time
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


def _verify(target_graphdef, target_params, cache, tree, *, attend_len, taps, attn_impl):
  """Target pass over ``[root] + tree`` at positions ``length + depth``."""
  target_model = nnx.merge(target_graphdef, target_params)
  return target_model(tree.tokens, cache.lengths[:, None] + tree.depth, cache, tree.mask,
                      attend_len=attend_len, taps=taps, attn_impl=attn_impl)


def _accept(tree, out, history, active, key, *, sampling, max_depth):
  """Acceptance, KV compaction and history update -> (acceptance, cache, history,
  advance [B], taps of the accepted path [B, A, n*H])."""
  acc = accept_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, out.logits,
                    key, sampling, max_depth=max_depth)
  advance = acc.num_new * active.astype(jnp.int32)
  history = layers.write_rows(history, acc.new_tokens, out.cache.lengths + 1)
  cache = out.cache.compact(acc.path, advance)
  return acc, cache, history, advance, layers.gather_rows(out.taps, acc.path)


def _draft_next(target_graphdef, head_graphdef, target_params, head_params, acc, path_taps,
                draft_cache, advance, *, attend_len, attn_impl):
  """The head drafts the next round from the accepted path's taps."""
  target_model = nnx.merge(target_graphdef, target_params)
  head = nnx.merge(head_graphdef, head_params)
  return _draft(target_model, head, path_taps, acc.new_tokens, acc.num_new, draft_cache,
                advance, attend_len, attn_impl)


def _search(head_params, ngram, state, *, tree_config, context_size):
  return search_trees(state.draft_logits, state.history, state.cache.lengths, ngram,
                      head_params["d2t"][...], tree_config, context_size)


def _no_wrap(name, fn):
  del name
  return fn


def _round(target_graphdef, target_params, head_graphdef, head_params, ngram, state,
           active, key, *, tree_config, sampling, attend_len, attn_impl, context_size,
           wrap=_no_wrap):
  """One DART round, phase by phase; ``wrap(name, fn)`` may wrap each phase (the
  profile mode jits and times them one by one)."""
  head_config = nnx.merge(head_graphdef, head_params).config
  search = functools.partial(_search, tree_config=tree_config, context_size=context_size)
  verify = functools.partial(_verify, target_graphdef, attend_len=attend_len,
                             taps=head_config.tap_layers, attn_impl=attn_impl)
  accept = functools.partial(_accept, sampling=sampling,
                             max_depth=head_config.draft_length + 1)
  draft = functools.partial(_draft_next, target_graphdef, head_graphdef,
                            attend_len=attend_len, attn_impl=attn_impl)
  tree = wrap("search", search)(head_params, ngram, state)
  out = wrap("verify", verify)(target_params, state.cache, tree)
  acc, cache, history, advance, path_taps = wrap("accept", accept)(
      tree, out, state.history, active, key)
  draft_logits, draft_cache = wrap("draft", draft)(
      target_params, head_params, acc, path_taps, state.draft_cache, advance)
  return DartState(cache, draft_cache, history, draft_logits), acc.new_tokens, acc.num_new


dart_round = jax.jit(
    _round,
    static_argnames=("target_graphdef", "head_graphdef", "tree_config", "sampling",
                     "attend_len", "attn_impl", "context_size", "wrap"),
    donate_argnames=("state",))


_PHASE_FNS = {}  # profile mode: compiled phases by (name, static configuration)


class DartDecoder:
  """``generate``'s decoder for ``draft=DartHead``.

  profile=True runs each round's phases (search, verify, accept, draft) as
  separately compiled calls and accumulates their seconds in ``phase_s``; the
  fused round is what normal decoding runs (slightly faster than the sum).
  """

  def __init__(self, target: Target, head: DartHead, *, sampling: SamplingConfig,
               seed: int = 0, ngram=None, tree: TreeConfig | None = None,
               profile: bool = False):
    head.check_target(target)
    self.target, self.head = target, head
    self.sampling = sampling
    self.tree_config = tree or TreeConfig()
    self.table = _as_table(ngram)
    order = getattr(self.table, "order", 2) if self.table is not None else 2
    self.context_size = max(order - 1, 1)
    self.scratch_rows = self.tree_config.remain_total + 1
    self.key = jax.random.PRNGKey(seed)
    self.profile = profile
    self.phase_s = {}

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
    first, state = dart_prefill(
        t.graphdef, t.params, h.graphdef, h.params, cache, draft_cache, tokens,
        prompt_lens, self._next_key(), sampling=self.sampling, attn_impl=t.attn_impl)
    return state, first

  def step(self, state, active, attend_len):
    t, h = self.target, self.head
    static = dict(tree_config=self.tree_config, sampling=self.sampling,
                  attend_len=attend_len, attn_impl=t.attn_impl,
                  context_size=self.context_size)
    args = (t.graphdef, t.params, h.graphdef, h.params, self.table, state, active,
            self._next_key())
    if not self.profile:
      return dart_round(*args, **static)
    key = (t.graphdef, h.graphdef, *sorted(static.items()))
    return _round(*args, **static, wrap=functools.partial(self._timed, key))

  def _timed(self, static_key, name, fn):
    """Compiles a phase once per static configuration and times each call."""
    jitted = _PHASE_FNS.setdefault((name, static_key), jax.jit(fn))

    def run(*args):
      start = time.perf_counter()
      out = jax.block_until_ready(jitted(*args))
      self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - start
      return out

    return run


def _as_table(ngram):
  """Accepts an ``NGram`` (converted once) or a device table."""
  if ngram is None:
    return None
  to_table = getattr(ngram, "to_table", None)
  return to_table() if to_table is not None else ngram
