"""DARTree speculative decoding (and its baselines): one compiled function per round.

Round (spec dartree.md sections 3-4), all on device:
  tree from last round's backbone output (``dartree_build``, vmapped) ->
  one target pass over ``[root] + tree`` with the ancestor mask, tapping the
  drafter's target layer outputs -> sample-and-match acceptance -> target KV
  compaction -> the taps of the accepted path (root included) become new
  drafter context (written at the drafter cache length, which advances by the
  number of new tokens) -> one backbone pass on ``[new root, MASK...]`` gives
  the next round's base logits (its block K/V are scratch, dropped).
The phases are DART's (search / verify / accept / draft, see
``dart_jax.speculative``); ``profile=True`` compiles and times them one by one.

Methods (``generate(..., draft=drafter, tree=...)``): "dartree" (pruned,
default), "dartree-fixed", "ddtree", "chain" (Domino chain for a Domino
drafter, DFlash chain otherwise), "dflash-chain", "domino-chain". Tree shape:
``tree_config=DARTreeConfig(topk=64, supertree_width=12, budget=64,
depth_bonus=-0.2)`` or the same names as keyword arguments.
"""

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.decode.ar import prefill
from dart_jax.draft.dart_gru import DartGruModule
from dart_jax.draft.dflash import DFlashDrafter, draft_block
from dart_jax.errors import InputError
from dart_jax.models import layers
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.profiling import PhaseTimer, Wrap, no_wrap
from dart_jax.sampling import KeySequence, SamplingConfig
from dart_jax.speculative import root_tokens, verify_trees
from dart_jax.tree.dartree import (CORRECTED_METHODS, DARTreeConfig, dartree_build,
                                   num_tree_nodes, resolve_method)
from dart_jax.verify import accept_tree


@dataclasses.dataclass(frozen=True)
class CorrectedTrees:
  """DART-GRU's search phase (a ``speculative.TreeBuilder``, run inside DART's
  round): ``dartree_build`` over the D+1 DART levels, with the correction for
  the corrected methods and the head's ``d2t`` mapping draft ids to target ids.

  method: a ``dart_jax.tree.dartree.TREE_METHODS`` name; num_nodes: N of its trees.
  """

  method: str
  tree: DARTreeConfig
  num_nodes: int

  @property
  def needs_hidden(self) -> bool:
    return self.method in CORRECTED_METHODS

  def __call__(self, target_model, head: DartGruModule, state) -> Any:
    build = lambda lg, r, h: dartree_build(lg, r, h, self.tree, method=self.method,
                                           d2t=head.dart.d2t[...])
    roots = root_tokens(state)
    if not self.needs_hidden:
      return jax.vmap(lambda lg, r: build(lg, r, None))(state.draft_logits, roots)
    correction = head.correction_head(target_model.embed_tokens.embedding[...],
                                      state.draft_hidden)  # z: [B, D+1, E]
    return jax.vmap(lambda lg, r, z: build(lg, r, correction.replace(z=z)))(
        state.draft_logits, roots, correction.z)


@flax.struct.dataclass
class DARTreeState:
  """Device state between rounds.

  cache: target KV cache (committed tokens; the root is not in it).
  draft_cache: drafter context K/V by real position (same lengths as cache).
  root: [B] the last emitted token (next round's tree root).
  base_logits: [B, D, V] float32 backbone logits for the next round.
  hidden: [B, D, H] normed backbone outputs of slots 1..B-1 (Domino's ``hid``).
  """

  cache: KVCache
  draft_cache: KVCache
  root: jax.Array
  base_logits: jax.Array
  hidden: jax.Array


def _draft(target_model, drafter, taps, advance, root, draft_cache, attend_len,
           attn_impl):
  """New context rows + one backbone pass -> (base_logits, hidden, draft_cache).

  taps: [B, C, n*Ht] at positions ``draft_cache.lengths + i``; the first
  ``advance[b]`` rows are real and committed.
  """
  draft_cache = drafter.write_context(taps, draft_cache)
  draft_cache = draft_cache.replace(lengths=draft_cache.lengths + advance)
  return draft_block(target_model, drafter, root, draft_cache, attend_len=attend_len,
                     attn_impl=attn_impl)


@functools.partial(
    jax.jit, static_argnames=("target_graphdef", "drafter_graphdef", "sampling",
                              "attn_impl"),
    donate_argnames=("cache", "draft_cache"))
def dartree_prefill(target_graphdef, target_params, drafter_graphdef, drafter_params,
                    cache, draft_cache, tokens, prompt_lens, key, *, sampling, attn_impl):
  """Prefills target and drafter; returns (first tokens [B], DARTreeState)."""
  drafter = nnx.merge(drafter_graphdef, drafter_params)
  first, cache, taps = prefill(target_graphdef, target_params, cache, tokens, prompt_lens,
                               key, sampling=sampling, taps=drafter.config.taps,
                               attn_impl=attn_impl)
  target_model = nnx.merge(target_graphdef, target_params)
  base_logits, hidden, draft_cache = _draft(
      target_model, drafter, taps, prompt_lens.astype(jnp.int32), first, draft_cache,
      None, attn_impl)
  return first, DARTreeState(cache, draft_cache, first, base_logits, hidden)


def build_trees(drafter, embed_table, state: DARTreeState, *, method: str,
                tree_config: DARTreeConfig):
  """Batched tree construction from the state -> a batched ``Tree``."""
  build = functools.partial(dartree_build, config=tree_config, method=method)
  if method not in CORRECTED_METHODS:
    return jax.vmap(lambda lg, r: build(lg, r, None))(state.base_logits, state.root)
  head = drafter.correction_head(embed_table, state.hidden)  # z: [B, D, E]
  return jax.vmap(lambda lg, r, z: build(lg, r, head.replace(z=z)))(
      state.base_logits, state.root, head.z)


def _search(target_graphdef, drafter_graphdef, target_params, drafter_params, state, *,
            method, tree_config):
  """The round's tree from last round's backbone output (``build_trees``)."""
  target_model = nnx.merge(target_graphdef, target_params)
  drafter = nnx.merge(drafter_graphdef, drafter_params)
  return build_trees(drafter, target_model.embed_tokens.embedding[...], state,
                     method=method, tree_config=tree_config)


def _accept(tree, out, active, key, *, sampling, max_depth):
  """Acceptance and KV compaction -> (acceptance, cache, new root [B], advance
  [B], taps of the accepted path [B, D+1, n*Ht], root first)."""
  acc = accept_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, out.logits,
                    key, sampling, max_depth=max_depth)
  advance = acc.num_new * active.astype(jnp.int32)
  cache = out.cache.compact(acc.path, advance)
  root = jnp.take_along_axis(acc.new_tokens, (acc.num_new - 1)[:, None], axis=1)[:, 0]
  return acc, cache, root, advance, layers.gather_rows(out.taps, acc.path)


def _draft_next(target_graphdef, drafter_graphdef, target_params, drafter_params,
                path_taps, advance, root, draft_cache, *, attend_len, attn_impl):
  """The accepted path becomes context; the backbone drafts the next round."""
  target_model = nnx.merge(target_graphdef, target_params)
  drafter = nnx.merge(drafter_graphdef, drafter_params)
  # The drafter's block reads up to D+1 rows past the committed length.
  draft_attend = min(attend_len + drafter.config.block_size, draft_cache.capacity)
  return _draft(target_model, drafter, path_taps, advance, root, draft_cache,
                draft_attend, attn_impl)


def _round(target_graphdef, target_params, drafter_graphdef, drafter_params, state,
           active, key, *, method, tree_config, sampling, attend_len, attn_impl,
           wrap: Wrap = no_wrap):
  """One DARTree round, phase by phase (search, verify, accept, draft, as in
  DART's round); ``wrap(name, fn)`` may wrap each phase (the profile mode
  compiles and times them one by one)."""
  c = nnx.merge(drafter_graphdef, drafter_params).config
  search = functools.partial(_search, target_graphdef, drafter_graphdef, method=method,
                             tree_config=tree_config)
  verify = functools.partial(verify_trees, target_graphdef, attend_len=attend_len,
                             taps=c.taps, attn_impl=attn_impl)
  accept = functools.partial(_accept, sampling=sampling, max_depth=c.num_depths)
  draft = functools.partial(_draft_next, target_graphdef, drafter_graphdef,
                            attend_len=attend_len, attn_impl=attn_impl)
  tree = wrap("search", search)(target_params, drafter_params, state)
  out = wrap("verify", verify)(target_params, state.cache, tree)
  acc, cache, root, advance, path_taps = wrap("accept", accept)(tree, out, active, key)
  base_logits, hidden, draft_cache = wrap("draft", draft)(
      target_params, drafter_params, path_taps, advance, root, state.draft_cache)
  return (DARTreeState(cache, draft_cache, root, base_logits, hidden), acc.new_tokens,
          acc.num_new)


dartree_round = jax.jit(
    _round,
    static_argnames=("target_graphdef", "drafter_graphdef", "method", "tree_config",
                     "sampling", "attend_len", "attn_impl", "wrap"),
    donate_argnames=("state",))


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(DARTreeConfig))


def tree_options(tree, tree_config: DARTreeConfig | None, overrides: dict,
                 has_head: bool) -> tuple[str, DARTreeConfig]:
  """``generate``'s DARTree options -> (method name, ``DARTreeConfig``).

  tree: a method name, a ``DARTreeConfig`` (method "dartree") or None
  ("dartree"); overrides: ``DARTreeConfig`` fields given as keyword arguments;
  has_head: whether the drafter carries a correction head. Raises InputError /
  ConfigError for unknown or ill-typed options.
  """
  unknown = sorted(set(overrides) - set(_CONFIG_FIELDS))
  if unknown:
    raise InputError(f"unknown DARTree option(s) {unknown}; options: tree, "
                     f"tree_config, {', '.join(_CONFIG_FIELDS)}")
  if isinstance(tree, DARTreeConfig):
    tree_config, tree = tree, "dartree"
  if tree is None:
    tree = "dartree"
  if not isinstance(tree, str):
    raise InputError(f"tree={tree!r}: pass a DARTree method name or a DARTreeConfig")
  if tree_config is not None and not isinstance(tree_config, DARTreeConfig):
    raise InputError(f"tree_config must be a DARTreeConfig, got "
                     f"{type(tree_config).__name__}")
  return (resolve_method(tree, has_head),
          dataclasses.replace(tree_config or DARTreeConfig(), **overrides))


class DARTreeDecoder:
  """``generate``'s decoder for ``draft=DFlashDrafter``.

  Args:
    target: the target model.
    drafter: a DFlash drafter (with the Domino head for the corrected methods).
    sampling: target sampling configuration.
    seed: RNG seed.
    ngram: must be None (DARTree uses no N-gram model).
    tree: method name ("dartree", "dartree-fixed", "ddtree", "chain",
      "dflash-chain", "domino-chain") or a ``DARTreeConfig`` (method "dartree").
    tree_config: a ``DARTreeConfig``; its fields may also be given as keyword
      arguments (``topk``, ``supertree_width``, ``budget``, ``depth_bonus``).
    profile: run each round's phases (search, verify, accept, draft) as
      separately compiled calls and accumulate their seconds in ``phase_s``;
      the fused round is what normal decoding runs (slightly faster than the sum).
  """

  def __init__(self, target: Target, drafter: DFlashDrafter, *, sampling: SamplingConfig,
               seed: int = 0, ngram=None, tree="dartree",
               tree_config: DARTreeConfig | None = None, profile: bool = False,
               **overrides):
    if ngram is not None:
      raise InputError("DARTree methods use no N-gram model; drop ngram=...")
    method, tree_config = tree_options(tree, tree_config, overrides, drafter.domino)
    drafter.check_target(target)
    self.target, self.drafter = target, drafter
    self.method, self.tree_config = method, tree_config
    self.sampling = sampling
    c = drafter.config
    self.num_nodes = num_tree_nodes(self.method, self.tree_config, c.num_depths,
                                    c.vocab_size)
    self.scratch_rows = self.num_nodes + 1
    self.keys = KeySequence(seed)
    self.profile = profile
    self.timer = PhaseTimer()
    self.phase_s = self.timer.seconds  # filled in profile mode

  def start(self, tokens, prompt_lens, capacity, key=None):
    t, d = self.target, self.drafter
    c = d.config
    if capacity < tokens.shape[1] + self.scratch_rows:
      raise InputError(f"a tree of {self.num_nodes} nodes does not fit a cache of "
                       f"{capacity} rows after a {tokens.shape[1]}-token prompt; raise "
                       "max_length or use a smaller budget")
    batch = tokens.shape[0]
    cache = t.new_cache(batch, capacity)
    # Context rows (up to D+1 per round) and the block's B scratch rows go past
    # the committed length.
    draft_cache = KVCache.for_attention(c.num_layers, batch, capacity + 2 * c.block_size,
                                        c.num_kv_heads, c.head_dim, t.dtype, t.attn_impl)
    first, state = dartree_prefill(
        t.graphdef, t.params, d.graphdef, d.params, cache, draft_cache, tokens,
        prompt_lens, self.keys.next(), sampling=self.sampling, attn_impl=t.attn_impl)
    return state, first

  def step(self, state, active, attend_len):
    t, d = self.target, self.drafter
    static = dict(method=self.method, tree_config=self.tree_config,
                  sampling=self.sampling, attend_len=attend_len, attn_impl=t.attn_impl)
    args = (t.graphdef, t.params, d.graphdef, d.params, state, active, self.keys.next())
    if not self.profile:
      return dartree_round(*args, **static)
    wrap = self.timer.wrap(_round, t.graphdef, d.graphdef, *sorted(static.items()))
    return _round(*args, **static, wrap=wrap)
