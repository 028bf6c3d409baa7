"""DARTree (and its baselines) as a proposer: a DFlash block drafter's trees.

Round (``docs/algorithms.md``, "DARTree"): the tree is built from last round's
backbone output (``dartree_build``, vmapped over the batch; with the Domino
correction for the corrected methods); after verification the taps of the
accepted path (root included) become drafter context, written at the drafter
cache length, which advances by the number of new tokens; one backbone pass on
``[new root, MASK...]`` gives the next round's base logits (its block K/V are
scratch, dropped).

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

from dart_jax.decode.round import RoundState, SpeculativeDecoder, root_tokens
from dart_jax.draft.dflash import DFlashConfig, DFlashDrafter, draft_block
from dart_jax.errors import InputError
from dart_jax.models import static_graph
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import Tree
from dart_jax.tree.dartree import (CORRECTED_METHODS, DARTreeConfig, dartree_build,
                                   num_tree_nodes, resolve_method)


@flax.struct.dataclass
class DARTreeDraft:
  """DARTree's state between rounds.

  cache: drafter context K/V by real position (the target's lengths).
  base_logits: [B, D, V] float32 backbone logits for the next round.
  hidden: [B, D, H] normed backbone outputs of slots 1..B-1 (Domino's ``hid``).
  """

  cache: KVCache
  base_logits: jax.Array
  hidden: jax.Array


def build_trees(drafter, embed_table, base_logits, hidden, roots, *, method: str,
                tree_config: DARTreeConfig) -> Tree:
  """Batched tree construction -> a batched ``Tree``.

  base_logits: [B, D, V]; hidden: [B, D, H]; roots: [B]; embed_table: [V, H]
  the target's (the correction embeds target ids).
  """
  build = functools.partial(dartree_build, config=tree_config, method=method)
  if method not in CORRECTED_METHODS:
    return jax.vmap(lambda lg, r: build(lg, r, None))(base_logits, roots)
  head = drafter.correction_head(embed_table, hidden)  # z: [B, D, E]
  return jax.vmap(lambda lg, r, z: build(lg, r, head.replace(z=z)))(
      base_logits, roots, head.z)


@dataclasses.dataclass(frozen=True)
class DARTreeProposer:
  """DARTree's proposer (``dart_jax.decode.round.Proposer``).

  draft_params: the drafter's params.
  """

  drafter_graphdef: Any
  config: DFlashConfig
  method: str
  tree_config: DARTreeConfig
  num_nodes: int

  def __post_init__(self):
    static_graph.use_static_graphdefs(self)  # hashed on every round's call

  @property
  def taps(self) -> tuple[int, ...]:
    return self.config.taps

  @property
  def max_depth(self) -> int:
    return self.config.num_depths

  def check_fits(self, capacity: int, prompt_len: int) -> None:
    if capacity < prompt_len + self.num_nodes + 1:
      raise InputError(f"a tree of {self.num_nodes} nodes does not fit a cache of "
                       f"{capacity} rows after a {prompt_len}-token prompt; raise "
                       "max_length or use a smaller budget")

  def new_draft_cache(self, batch, capacity, dtype, attn_impl, mesh=None):
    c = self.config
    # Context rows (up to D+1 per round) and the block's B scratch rows go past
    # the committed length.
    return KVCache.for_attention(c.num_layers, batch, capacity + 2 * c.block_size,
                                 c.num_kv_heads, c.head_dim, dtype, attn_impl, mesh=mesh)

  def _draft(self, target_model, draft_params, taps, advance, root, cache, attend_len,
             attn_impl) -> DARTreeDraft:
    """New context rows + one backbone pass.

    taps: [B, C, n*Ht] at positions ``cache.lengths + i``; the first
    ``advance[b]`` rows are real and committed.
    """
    drafter = nnx.merge(self.drafter_graphdef, draft_params)
    cache = drafter.write_context(taps, cache)
    cache = cache.replace(lengths=cache.lengths + advance)
    base_logits, hidden, cache = draft_block(target_model, drafter, root, cache,
                                             attend_len=attend_len, attn_impl=attn_impl)
    return DARTreeDraft(cache, base_logits, hidden)

  def start(self, target_model, draft_params, draft_cache, taps, tokens, prompt_lens,
            first, history, attn_impl) -> DARTreeDraft:
    del tokens, history
    return self._draft(target_model, draft_params, taps, prompt_lens, first, draft_cache,
                       None, attn_impl)

  def propose(self, target_model, draft_params, state: RoundState) -> Tree:
    drafter = nnx.merge(self.drafter_graphdef, draft_params)
    return build_trees(drafter, target_model.embed_tokens.embedding[...],
                       state.draft.base_logits, state.draft.hidden, root_tokens(state),
                       method=self.method, tree_config=self.tree_config)

  def update(self, target_model, draft_params, draft: DARTreeDraft, acc, path_taps,
             advance, history, *, attend_len, attn_impl) -> DARTreeDraft:
    del history
    # The new root: the last emitted token (the bonus token).
    root = jnp.take_along_axis(acc.new_tokens, (acc.num_new - 1)[:, None], axis=1)[:, 0]
    # The drafter's block reads up to D+1 rows past the committed length.
    draft_attend = min(attend_len + self.config.block_size, draft.cache.capacity)
    return self._draft(target_model, draft_params, path_taps, advance, root, draft.cache,
                       draft_attend, attn_impl)


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


def dartree_decoder(target: Target, drafter: DFlashDrafter, method: str,
                    tree_config: DARTreeConfig, *, sampling: SamplingConfig,
                    seed: int = 0, profile: bool = False) -> SpeculativeDecoder:
  """The decoder of ``generate(..., draft=DFlashDrafter)`` for one tree method."""
  drafter.check_target(target)
  c = drafter.config
  proposer = DARTreeProposer(drafter.graphdef, c, method, tree_config,
                             num_tree_nodes(method, tree_config, c.num_depths,
                                            c.vocab_size))
  return SpeculativeDecoder(target, proposer, drafter.params, sampling=sampling, seed=seed,
                            profile=profile)
