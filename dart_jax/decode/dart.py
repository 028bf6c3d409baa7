"""DART as a proposer: the head drafts D+1 levels, a beam search builds the tree.

Round (``docs/algorithms.md``, "DART"): the search mixes last round's draft
logits with the N-gram term (the shipped trie, plus each sequence's context
N-gram) into a tree; after verification the head runs once on the accepted
path's taps and tokens and drafts the next round's levels.

DART-GRU (``DartGruProposer``) is the same proposer with another search: the
DARTree tree builder over the D+1 levels, with the GRU correction for the
corrected methods.
"""

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.decode.round import RoundState, SpeculativeDecoder, root_tokens
from dart_jax.decode.verify import Acceptance
from dart_jax.draft.dart_gru import DartGruDrafter
from dart_jax.draft.dart_head import DartConfig, DartHead
from dart_jax.errors import InputError
from dart_jax.models import static_graph
from dart_jax.models.target import Target
from dart_jax.models.transformer import KVCache
from dart_jax.ngram.context import ContextNGram, ContextNGramConfig
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import Tree, TreeConfig, level_candidates, search_batch
from dart_jax.tree.dartree import (CORRECTED_METHODS, DARTreeConfig, dartree_build,
                                   num_tree_nodes)

DEFAULT_CONTEXT_NGRAM = ContextNGramConfig()


@flax.struct.dataclass
class DartDraft:
  """DART's state between rounds.

  cache: the head's one-layer cache of real positions (the target's lengths).
  logits: [B, D+1, Vd] the head's drafts for the next round.
  hidden: [B, D+1, H] the hidden ``lm_head`` read for them, kept only when
    the search needs it (DART-GRU's corrected trees; else None).
  context: each sequence's ``ContextNGram`` of its committed tokens, when the
    search uses one (else None).
  """

  cache: KVCache
  logits: jax.Array
  hidden: jax.Array | None = None
  context: ContextNGram | None = None


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
                 context_size: int, context: ContextNGram | None = None) -> Tree:
  """Batched DART tree search -> a batched ``Tree``; ``context`` (one row per
  sequence) adds the context N-gram to the search."""
  window, window_len = context_window(history, root_pos, context_size)
  tokens, log_probs = jax.vmap(lambda lg: level_candidates(lg, tree_config, d2t))(
      draft_logits)
  return search_batch(tokens, log_probs, window, ngram, tree_config, window_len, context)


@dataclasses.dataclass(frozen=True)
class DartProposer:
  """DART's proposer (``dart_jax.decode.round.Proposer``).

  draft_params: {"head": the head's params, "ngram": an ``NGramTable`` or None}.
  """

  head_graphdef: Any
  config: DartConfig
  num_nodes: int
  tree_config: TreeConfig | None = None
  context_config: ContextNGramConfig | None = None
  context_size: int = 1

  def __post_init__(self):
    static_graph.use_static_graphdefs(self)  # hashed on every round's call

  @property
  def taps(self) -> tuple[int, ...]:
    return self.config.tap_layers

  @property
  def max_depth(self) -> int:
    # D+1 levels, and no deeper than a chain of all N nodes: a 5-node tree's
    # accepted path is 6 rows, not 7 (acceptance, the path's taps and the
    # head's next pass are that much shorter).
    return min(self.config.draft_length + 1, self.num_nodes)

  @property
  def with_hidden(self) -> bool:
    return False

  def check_fits(self, capacity: int, prompt_len: int) -> None:
    d = self.config.draft_length
    if capacity < prompt_len + d:
      raise InputError(f"draft length D={d} does not fit a cache of {capacity} rows; "
                       "raise max_length or use a smaller D")

  def new_draft_cache(self, batch, capacity, dtype, attn_impl, mesh=None):
    c = self.config
    # The head writes up to D+2 real rows and D mask rows past the committed length.
    return KVCache.for_attention(1, batch, capacity + 2 * c.draft_length + 2,
                                 c.num_kv_heads, c.head_dim, dtype, attn_impl, mesh=mesh)

  def _draft(self, target_model, draft_params, taps, next_tokens, num_real, cache, advance,
             attend_len, attn_impl):
    """The head on new real positions -> (logits, hidden or None, cache)."""
    head = nnx.merge(self.head_graphdef, draft_params["head"])
    hidden, cache = head.levels(taps, target_model.embed(next_tokens), num_real, cache,
                                attend_len=attend_len, attn_impl=attn_impl)
    return (head.logits(hidden), hidden if self.with_hidden else None,
            cache.replace(lengths=cache.lengths + advance))

  def start(self, target_model, draft_params, draft_cache, taps, tokens, prompt_lens,
            first, history, attn_impl) -> DartDraft:
    batch, length = tokens.shape
    col = jnp.arange(length)[None, :]
    # The head pairs the taps at position p with the token at p+1; the token after
    # the last prompt position is the root (the first generated token).
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], 1)
    next_tokens = jnp.where(col == (prompt_lens - 1)[:, None], first[:, None], shifted)
    logits, hidden, cache = self._draft(target_model, draft_params, taps, next_tokens,
                                        prompt_lens, draft_cache, prompt_lens, 1, attn_impl)
    context = None
    if self.context_config is not None:
      context = ContextNGram.empty(batch, history.shape[1], self.context_config).add(
          history, jnp.ones((batch,), jnp.int32), prompt_lens, max_count=length)
    return DartDraft(cache, logits, hidden, context)

  def propose(self, target_model, draft_params, state: RoundState) -> Tree:
    del target_model
    return search_trees(state.draft.logits, state.history, state.cache.lengths,
                        draft_params["ngram"], draft_params["head"]["d2t"][...],
                        self.tree_config, self.context_size, state.draft.context)

  def update(self, target_model, draft_params, draft: DartDraft, acc: Acceptance,
             path_taps, advance, history, *, attend_len, attn_impl) -> DartDraft:
    context = draft.context
    if context is not None:
      # The head's cache has the target's lengths before this round's tokens.
      context = context.add(history, draft.cache.lengths + 1, advance,
                            max_count=acc.new_tokens.shape[1])
    logits, hidden, cache = self._draft(target_model, draft_params, path_taps,
                                        acc.new_tokens, acc.num_new, draft.cache, advance,
                                        attend_len, attn_impl)
    return DartDraft(cache, logits, hidden, context)


@dataclasses.dataclass(frozen=True)
class DartGruProposer(DartProposer):
  """DART-GRU: DART's drafting with DARTree's (corrected) trees over its levels.

  method: a ``dart_jax.tree.dartree.TREE_METHODS`` name; dartree_config: the
  tree shape. draft_params: {"head": the DART head's params, "correction":
  the correction's}.
  """

  correction_graphdef: Any = None
  method: str = "dartree"
  dartree_config: DARTreeConfig = DARTreeConfig()

  @property
  def with_hidden(self) -> bool:
    return self.method in CORRECTED_METHODS

  def propose(self, target_model, draft_params, state: RoundState) -> Tree:
    d2t = draft_params["head"]["d2t"][...]
    build = lambda lg, r, h: dartree_build(lg, r, h, self.dartree_config,
                                           method=self.method, d2t=d2t)
    roots, draft = root_tokens(state), state.draft
    if not self.with_hidden:
      return jax.vmap(lambda lg, r: build(lg, r, None))(draft.logits, roots)
    correction = nnx.merge(self.correction_graphdef, draft_params["correction"])
    head = correction.correction_head(target_model.embed_tokens.embedding[...],
                                      draft.hidden)  # z: [B, D+1, E]
    return jax.vmap(lambda lg, r, z: build(lg, r, head.replace(z=z)))(
        draft.logits, roots, head.z)


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


def dart_decoder(target: Target, head: DartHead, *, sampling: SamplingConfig,
                 seed: int = 0, ngram=None, tree: TreeConfig | None = None,
                 context_ngram: bool | ContextNGramConfig | None = None,
                 profile: bool = False) -> SpeculativeDecoder:
  """The decoder of ``generate(..., draft=DartHead)``.

  tree: the search's ``TreeConfig`` (default: the head's for this target,
  ``DartHead.default_tree``, else ``TreeConfig()``);
  a ``"target"`` EOS in it (the default) becomes the target's EOS.
  context_ngram: True / a ``ContextNGramConfig`` to mix each sequence's own
    n-gram counts into the search's N-gram term (``dart_jax.ngram.context``),
    False for the reference search; None = ``DEFAULT_CONTEXT_NGRAM``.
  """
  head.check_target(target)
  tree_config = (tree or head.default_tree(target) or TreeConfig()).with_target_eos(
      target_eos_id(target))
  context_config = resolve_context_ngram(context_ngram)
  table = _as_table(ngram)
  order = getattr(table, "order", 2) if table is not None else 2
  context_width = context_config.width if context_config else 0
  proposer = DartProposer(head.graphdef, head.config, tree_config.remain_total,
                          tree_config, context_config,
                          max(order - 1, context_width, 1))
  return SpeculativeDecoder(target, proposer, {"head": head.params, "ngram": table},
                            sampling=sampling, seed=seed, profile=profile)


def dart_gru_decoder(target: Target, drafter: DartGruDrafter, method: str,
                     tree_config: DARTreeConfig, *, sampling: SamplingConfig,
                     seed: int = 0, profile: bool = False) -> SpeculativeDecoder:
  """The decoder of ``generate(..., draft=DartGruDrafter)`` for one tree method."""
  drafter.check_target(target)
  head = drafter.dart_head()
  c = head.config
  correction_graphdef, correction_params = nnx.split(drafter.correction_module())
  proposer = DartGruProposer(
      head.graphdef, c, num_tree_nodes(method, tree_config, c.num_levels,
                                       c.draft_vocab_size),
      correction_graphdef=correction_graphdef, method=method, dartree_config=tree_config)
  return SpeculativeDecoder(target, proposer,
                            {"head": head.params, "correction": correction_params},
                            sampling=sampling, seed=seed, profile=profile)
