"""DART tree search (``docs/algorithms.md``, "DART") as one static-shape jittable function.

Formulation. Level l expands the B_l beam members (B_0 = 1, B_{l+1} =
min(beam_width, B_l * k)) into B_l * k children, all recorded in fixed arrays
with a parent pointer; the next beam is the best `beam_width` of them. After
the last level the best `remain_total` of all R = k * sum_l B_l recorded
children form the tree, reindexed to BFS order. All shapes are static. Each
beam member carries the `NGramTable` nodes of its context suffixes, so the
N-gram term of a level is one batch of hashed lookups (which also yields the
next members' nodes). Levels whose beam has reached its final size run as one
`lax.scan` body, so compile time does not grow with the depth.

With a context N-gram (``context_ngram``, beyond the reference; rule in
docs/context_ngram.md) each member expands one more, member-specific candidate and
the terms below take the context's estimate; without one the search is the
reference's bit for bit.

Scores follow the reference release exactly (float32 throughout):
  level 0:  s(c+t) = s(c) + lw(0) * (log(p_0(t) + eps) * gw(0))
  level l:  s(c+t) = s(c) + lw(l) * (log(p_l(t) + eps) * gw(l)
                                     + log(P_ng(t | ctx) + eps) * ngram_weight)
with p_l the softmax over the top-k draft logit VALUES of level l and ctx the
last order-1 tokens of context ++ path(c).

Deterministic tie-breaking (the numpy reference uses the same rule):
  - candidates of a level: by logit descending, then lower draft id;
  - beam cut: children not ending in EOS first, then score descending, then
    lower flat index b * k + j (b = beam rank of the parent, j = candidate
    rank);
  - final cut: score descending, then lower record index (records are stored
    level by level, flat index within a level). A parent is recorded before
    its children and never scores below them (every increment is <= 0), so it
    always ranks first: the kept set is prefix-closed even under ties.
  - BFS order: by depth, then by final rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dart_jax.errors import ConfigError, InputError
from dart_jax.models import precision
from dart_jax.ngram.context import ContextNGram
from dart_jax.ngram.table import NGramTable
from dart_jax.tree.config import TreeConfig
from dart_jax.tree.structure import Tree, build_tree
from kernels import cpu_matmul


_TOPK_CHUNK = 128
_KERNEL_MAX_WIDTH = 64  # context N-gram tokens the CPU kernel's search reads at most


def _barrier(outputs: tuple) -> tuple:
  return tuple(lax.optimization_barrier(x) for x in outputs)


def exact_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis of [R, V], faster on CPU for large V.

  Rows are cut into chunks of 128; the top-k elements lie in the k chunks
  with the largest maxima (ties: lower chunk first), which are gathered in
  ascending chunk order and searched again. The result equals `lax.top_k`
  exactly, ties (lower index first) included. The optimization barriers keep
  XLA from rewriting the top-k into a full sort when it is fused with the
  rest of the search; they wrap each output alone, as XLA:CPU's top-k pass
  fails on a barrier over the (values, index) pair once a mesh partitions the
  program.
  """
  rows, vocab = x.shape
  chunks = -(-vocab // _TOPK_CHUNK)
  if chunks <= 2 * k:
    values, index = _barrier(lax.top_k(x, k))
    return values, index.astype(jnp.int32)
  padded = jnp.pad(x, ((0, 0), (0, chunks * _TOPK_CHUNK - vocab)),
                   constant_values=-jnp.inf)
  blocks = padded.reshape(rows, chunks, _TOPK_CHUNK)
  _, best_chunks = lax.top_k(jnp.max(blocks, axis=-1), k)
  best_chunks = jnp.sort(best_chunks, axis=-1)
  candidates = jnp.take_along_axis(blocks, best_chunks[:, :, None], axis=1)
  values, pos = lax.top_k(candidates.reshape(rows, k * _TOPK_CHUNK), k)
  values, pos = _barrier((values, pos))
  chunk = jnp.take_along_axis(best_chunks, pos // _TOPK_CHUNK, axis=1)
  return values, (chunk * _TOPK_CHUNK + pos % _TOPK_CHUNK).astype(jnp.int32)


def level_candidates(logits: jax.Array, config: TreeConfig,
                     d2t: jax.Array | None = None):
  """Top-k candidates of every level and their log-probability terms.

  Args:
    logits: [D+1, Vd] draft logits (cast to float32).
    config: the search config (topk, eps).
    d2t: int32 [Vd] draft -> target offsets, or None for identity.

  Returns:
    (tokens int32 [D+1, k] target ids, log_probs float32 [D+1, k] =
    log(softmax(top-k values) + eps)).
  """
  values, index = exact_top_k(jnp.asarray(logits, jnp.float32), config.topk)
  tokens = index if d2t is None else index + jnp.asarray(d2t, jnp.int32)[index]
  probs = jax.nn.softmax(values, axis=-1)
  return tokens, jnp.log(probs + np.float32(config.eps))


def _beam_cut(scores: jax.Array, tokens: jax.Array, width: int,
              eos_id: int | None) -> jax.Array:
  """Flat indices of the next beam, best first ([width])."""
  if eos_id is None:
    return lax.top_k(scores, width)[1]
  # Non-EOS children by score, then EOS children by score. top_k breaks ties
  # by lower index; scores are finite, so -inf only marks the other class.
  is_eos = tokens == eos_id
  _, best_other = lax.top_k(jnp.where(is_eos, -jnp.inf, scores), width)
  _, best_eos = lax.top_k(jnp.where(is_eos, scores, -jnp.inf), width)
  num_other = jnp.sum(~is_eos)
  slot = jnp.arange(width)
  return jnp.where(slot < num_other, best_other,
                   best_eos[jnp.clip(slot - num_other, 0, width - 1)])


def search_candidates(tokens: jax.Array, log_probs: jax.Array,
                      context: jax.Array, ngram: NGramTable | None,
                      config: TreeConfig,
                      context_len: jax.Array | None = None,
                      context_ngram: ContextNGram | None = None) -> Tree:
  """The beam search of `dart_search`, from `level_candidates` outputs.

  Args:
    tokens: int32 [D+1, k] candidate target ids per level.
    log_probs: float32 [D+1, k] log(p + eps) of each candidate.
    context: int32 [C] last committed tokens, ending with the root.
    ngram: device table or None (no N-gram term).
    config: search config (static).
    context_len: int32 [] real trailing entries of `context` (None = all).
    context_ngram: this sequence's `ContextNGram` row, or None (the reference
      search, exactly). Used only when ngram_weight > 0: its estimate enters the
      N-gram term (`ContextNGram.mix`, levels >= 1), raises draft probabilities
      (``draft_weight``, all levels) and adds each member's copy prediction as a
      child (``inject``); see docs/context_ngram.md.
  """
  num_levels, k = tokens.shape
  c = context.shape[0]
  context = context.astype(jnp.int32)
  real_len = (jnp.int32(c) if context_len is None
              else jnp.clip(jnp.asarray(context_len, jnp.int32), 1, c))
  eps = np.float32(config.eps)
  ngram_weight = np.float32(config.ngram_weight)
  # The reference skips the lookups unless ngram_weight > 0 and then uses
  # probability 0: a constant log(eps) * weight (-0.0, a no-op, for weight 0).
  use_table = ngram is not None and config.ngram_weight > 0
  constant_ngram_term = ngram is not None and config.ngram_weight < 0
  width = ngram.order - 1 if use_table else 0
  use_context = context_ngram is not None and config.ngram_weight > 0
  context_width = context_ngram.config.width if use_context else 0
  if context_width > c:
    raise InputError(f"the context N-gram reads {context_width} tokens but the search "
                     f"gets a context of {c}")
  inject = use_context and context_ngram.config.inject
  draft_weight = np.float32(context_ngram.config.draft_weight if use_context else 0)
  children = k + 1 if inject else k  # children per beam member

  # Each beam member carries the N-gram nodes of the suffixes of
  # context ++ path (lengths 1..order-1), so a level costs one hashed lookup
  # per (member, candidate, suffix length), which also yields the next state.
  if use_table:
    if width > c:
      window = jnp.concatenate([jnp.zeros((width - c,), jnp.int32), context])
    else:
      window = context[c - width:]
    beam_nodes = ngram.suffix_nodes(window[None],
                                    jnp.minimum(real_len, width)[None])
  else:
    beam_nodes = jnp.zeros((1, 0), jnp.int32)
  # Each member also carries its last `context_width` tokens for the context table.
  first = c - context_width
  beam_context = (context[first:][None], (jnp.arange(first, c) >= c - real_len)[None])
  state = (jnp.zeros((1,), jnp.float32), jnp.full((1,), -1, jnp.int32),
           beam_nodes, beam_context)

  def expand(state, level_tokens, level_log_probs, level_weight, logit_weight,
             offset, with_ngram: bool, cut: bool):
    """Scores the children of one level and cuts the next beam."""
    beam_score, beam_record, beam_nodes, beam_context = state
    size = beam_score.shape[0]
    # Candidates: the level's top-k, shared by all members ([k]); with the context
    # table, per member ([size, children]), plus its copy prediction when injecting.
    candidates, draft_log_probs, fresh = level_tokens, level_log_probs[None, :], None
    if use_context:
      candidates = jnp.broadcast_to(level_tokens, (size, k))
      draft_log_probs = jnp.broadcast_to(level_log_probs, (size, k))
      if inject:
        copy = context_ngram.predict(*beam_context)  # [size]
        fresh = (copy >= 0) & ~jnp.any(candidates == copy[:, None], axis=1)
        candidates = jnp.concatenate(
            [candidates, jnp.where(fresh, copy, level_tokens[0])[:, None]], axis=1)
        # Outside the top-k the reference's draft probability is 0.
        draft_log_probs = jnp.concatenate(
            [draft_log_probs, jnp.full((size, 1), jnp.log(eps))], axis=1)
    next_nodes = None
    p_ngram = p_context = matched = None
    if use_table and (with_ngram or cut):
      p_ngram, _, next_nodes = ngram.step(beam_nodes, candidates)
    if use_context and (with_ngram or draft_weight > 0):
      p_context, matched = context_ngram.probability(*beam_context, candidates)
    if draft_weight > 0:
      p_draft = jnp.maximum(jnp.exp(draft_log_probs) - eps, 0.0)
      draft_log_probs = jnp.log(jnp.maximum(
          p_draft, draft_weight * jnp.where(matched > 0, p_context, 0.0)) + eps)
    inner = draft_log_probs * logit_weight  # [1 or size, children]
    if use_context and with_ngram:
      p_ngram = context_ngram.mix(0.0 if p_ngram is None else p_ngram, p_context,
                                  matched)
    if p_ngram is not None and with_ngram:
      inner = inner + jnp.log(p_ngram + eps) * ngram_weight
    elif constant_ngram_term and with_ngram:
      inner = inner + jnp.log(eps) * ngram_weight
    child_scores = beam_score[:, None] + level_weight * inner
    if inject:  # A copy prediction already in the top-k (or none) is no child.
      child_scores = child_scores.at[:, k].set(
          jnp.where(fresh, child_scores[:, k], -jnp.inf))
    child_scores = child_scores.reshape(-1)
    child_tokens = (candidates.reshape(-1) if use_context
                    else jnp.tile(level_tokens, size))
    records = (child_tokens, jnp.repeat(beam_record, children), child_scores)
    if not cut:
      return state, records
    # Void injected children score -inf: the cut keeps at most size * k members, so
    # it takes real children first.
    keep = _beam_cut(child_scores, child_tokens,
                     min(config.beam_width, size * k), config.search_eos_id)
    beam_nodes = (next_nodes.reshape(size * children, width)[keep] if use_table
                  else jnp.zeros((keep.shape[0], 0), jnp.int32))
    return (child_scores[keep], (offset + keep).astype(jnp.int32), beam_nodes,
            _extend_context(beam_context, child_tokens, keep)), records

  # Levels with the final beam size run as one lax.scan (one compiled body,
  # whatever the depth); the first, smaller levels are unrolled.
  sizes = config.beam_sizes(num_levels)
  first_scanned = next((l for l in range(1, num_levels)
                        if sizes[l] == sizes[-1]), num_levels)
  if num_levels - first_scanned < 2:
    first_scanned = num_levels
  level_weights, logit_weights = _level_weights(config, num_levels)
  offsets = np.concatenate([[0], np.cumsum(np.array(sizes) * children)]).astype(
      np.int32)
  record_parts = []
  for level in range(first_scanned):
    state, records = expand(
        state, tokens[level], log_probs[level], level_weights[level],
        logit_weights[level], int(offsets[level]), with_ngram=level > 0,
        cut=level + 1 < num_levels)
    record_parts.append(records)
  if first_scanned < num_levels:
    def body(state, xs):
      return expand(state, *xs, with_ngram=True, cut=True)
    scanned = slice(first_scanned, num_levels)
    _, records = lax.scan(body, state, (
        tokens[scanned], log_probs[scanned],
        jnp.asarray(level_weights[scanned]),
        jnp.asarray(logit_weights[scanned]), jnp.asarray(offsets[scanned])))
    record_parts.append(tuple(r.reshape(-1) for r in records))

  all_tokens = jnp.concatenate([r[0] for r in record_parts])
  all_parents = jnp.concatenate([r[1] for r in record_parts])
  all_scores = jnp.concatenate([r[2] for r in record_parts])
  all_levels = jnp.asarray(
      np.repeat(np.arange(num_levels, dtype=np.int32), np.array(sizes) * children))
  total = all_scores.shape[0]
  # As many nodes as the reference keeps: that many finite-scored records exist,
  # so a void injected child (-inf) is never kept.
  keep_count = config.num_tree_nodes(num_levels)
  _, ranked = lax.top_k(all_scores, keep_count)  # Ties: lower record first.
  # BFS order: by level, then by rank.
  bfs = ranked[jnp.argsort(all_levels[ranked] * keep_count
                           + jnp.arange(keep_count, dtype=jnp.int32))]
  node_of_record = jnp.zeros((total,), jnp.int32).at[bfs].set(
      jnp.arange(1, keep_count + 1, dtype=jnp.int32))
  parent_record = all_parents[bfs]
  parent_node = jnp.where(parent_record < 0, 0,
                          node_of_record[jnp.maximum(parent_record, 0)])

  pad = config.remain_total - keep_count
  node_tokens = jnp.concatenate([context[c - 1:], all_tokens[bfs],
                                 jnp.zeros((pad,), jnp.int32)])
  node_parents = jnp.concatenate([jnp.full((1,), -1, jnp.int32), parent_node,
                                  jnp.full((pad,), -1, jnp.int32)])
  node_depth = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                all_levels[bfs] + 1,
                                jnp.zeros((pad,), jnp.int32)])
  node_scores = jnp.concatenate([jnp.zeros((1,), jnp.float32), all_scores[bfs],
                                 jnp.full((pad,), -jnp.inf, jnp.float32)])
  return build_tree(node_tokens, node_parents, node_depth, node_scores,
                    jnp.int32(keep_count), max_depth=num_levels)


def search_batch(tokens: jax.Array, log_probs: jax.Array, context: jax.Array,
                 ngram: NGramTable | None, config: TreeConfig,
                 context_len: jax.Array | None = None,
                 context_ngram: ContextNGram | None = None) -> Tree:
  """`search_candidates` for a batch of sequences -> a batched `Tree`.

  tokens: int32 [B, D+1, k]; log_probs: float32 [B, D+1, k]; context: int32
  [B, C]; context_len: int32 [B] or None; context_ngram: B rows or None.
  Where the CPU kernels run (``precision.cpu_kernel_active``) the whole search
  is one FFI call (``kernels/cpu_matmul/dart_search.cc``): XLA:CPU runs it as a
  scan of ~15 small ops per level, ~1.0-1.3 ms of a ~25 ms DART round on the
  2-core Zen 3 with the context inserts, against ~0.2 ms for the two kernel
  calls. Its scores agree with this module's to float rounding (std::log vs
  XLA's log), so a near-tie at a cut may fall the other way: that changes which
  tokens are drafted, never the output.
  """
  batch, _, _ = tokens.shape
  if context_len is None:
    context_len = jnp.full((batch,), context.shape[1], jnp.int32)
  too_wide = context_ngram is not None and context_ngram.config.width > _KERNEL_MAX_WIDTH
  if not precision.cpu_kernel_active() or too_wide:
    return jax.vmap(lambda t, lp, ctx, n, table: search_candidates(
        t, lp, ctx, ngram, config, n, table))(tokens, log_probs, context, context_len,
                                               context_ngram)
  return _search_batch_kernel(tokens, log_probs, context, context_len, ngram, config,
                              context_ngram)


def _search_batch_kernel(tokens, log_probs, context, context_len, ngram, config,
                         context_ngram) -> Tree:
  batch, num_levels, _ = tokens.shape
  use_table = ngram is not None and config.ngram_weight > 0
  use_context = context_ngram is not None and config.ngram_weight > 0
  if use_table:
    table = (ngram.keys, ngram.counts, ngram.bucket_start)
    layout = np.array([*ngram.bucket_offset, *ngram.size, *ngram.window], np.int64)
  else:
    table = (jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
             jnp.zeros((1,), jnp.int32))
    layout = np.zeros((3,), np.int64)
  if use_context:
    context_config = context_ngram.config
    if context_config.width > context.shape[1]:
      raise InputError(f"the context N-gram reads {context_config.width} tokens but the "
                       f"search gets a context of {context.shape[1]}")
    context_table = (context_ngram.keys.reshape(batch, -1),
                     context_ngram.values.reshape(batch, -1))
  else:
    context_config = None
    context_table = (jnp.zeros((batch, 1), jnp.uint32), jnp.zeros((batch, 1), jnp.int32))
  weights = np.concatenate(_level_weights(config, num_levels))
  keep_count = config.num_tree_nodes(num_levels)
  eos_id = config.search_eos_id
  out = cpu_matmul.dart_search_tree(
      tokens.astype(jnp.int32), log_probs.astype(jnp.float32), context.astype(jnp.int32),
      jnp.asarray(context_len, jnp.int32).reshape(batch), table, context_table,
      jnp.asarray(weights), num_nodes=config.remain_total, table_layout=layout,
      beam_width=config.beam_width, keep_count=keep_count,
      eos_id=-1 if eos_id is None else int(eos_id), eps=np.float32(config.eps),
      ngram_weight=np.float32(config.ngram_weight), use_table=int(use_table),
      table_width=ngram.order - 1 if use_table else 0,
      constant_ngram_term=int(ngram is not None and config.ngram_weight < 0),
      context_width=context_config.width if use_context else 0,
      context_min_order=context_config.min_order if use_context else 0,
      context_weight=np.float32(context_config.weight if use_context else 0),
      context_draft_weight=np.float32(context_config.draft_weight if use_context else 0),
      context_inject=int(use_context and context_config.inject),
      context_probes=context_config.probes if use_context else 0)
  node_tokens, parents, depth, scores, mask, paths, num_leaves = out
  return Tree(tokens=node_tokens, parents=parents, depth=depth, mask=mask,
              num_nodes=jnp.full((batch,), keep_count, jnp.int32), paths=paths,
              num_leaves=num_leaves, scores=scores)


def _level_weights(config: TreeConfig, num_levels: int) -> tuple[np.ndarray, np.ndarray]:
  """float32 [D+1] each: the increments' weights and the draft terms' weights."""
  levels = range(num_levels)
  return (np.array([config.level_weight(l) for l in levels], np.float32),
          np.array([config.logit_weight(l) for l in levels], np.float32))


def _extend_context(beam_context, child_tokens, keep):
  """The last tokens of the kept children's contexts: the parent's, shifted, plus
  the child's token. beam_context: ([M, W] tokens, [M, W] valid); child_tokens:
  [M * children]; keep: [M'] flat child indices (member * children + candidate)."""
  tokens, valid = beam_context
  if tokens.shape[1] == 0:
    return (tokens[:1].repeat(keep.shape[0], 0), valid[:1].repeat(keep.shape[0], 0))
  parent = keep // (child_tokens.shape[0] // tokens.shape[0])
  return (jnp.concatenate([tokens[parent, 1:], child_tokens[keep][:, None]], 1),
          jnp.concatenate([valid[parent, 1:], jnp.ones((keep.shape[0], 1), bool)], 1))


def _check_inputs(logits, context, ngram, config, d2t, context_len):
  if not isinstance(config, TreeConfig):
    raise ConfigError(f"config must be a TreeConfig, got {type(config)}.")
  if getattr(logits, "ndim", None) != 2 or logits.shape[0] < 1:
    raise InputError("logits must be [D+1, Vd] (one row per draft level); got "
                     f"shape {getattr(logits, 'shape', None)}.")
  if config.topk > logits.shape[1]:
    raise ConfigError(f"TreeConfig.topk={config.topk} exceeds the draft "
                      f"vocabulary size {logits.shape[1]}.")
  if getattr(context, "ndim", None) != 1 or context.shape[0] < 1:
    raise InputError("context must be a 1-D int array of the last committed "
                     "tokens ending with the root token; got shape "
                     f"{getattr(context, 'shape', None)}.")
  if not jnp.issubdtype(context.dtype, jnp.integer):
    raise InputError(f"context must hold integer token ids, got {context.dtype}.")
  if d2t is not None and (getattr(d2t, "shape", None) != (logits.shape[1],)
                          or not jnp.issubdtype(d2t.dtype, jnp.integer)):
    raise InputError(f"d2t must be an int array of shape [{logits.shape[1]}] "
                     f"(one offset per draft id); got {getattr(d2t, 'shape', None)}.")
  if context_len is not None and jnp.shape(context_len) != ():
    raise InputError("context_len must be a scalar (per example); got shape "
                     f"{jnp.shape(context_len)}.")
  if ngram is not None and not isinstance(ngram, NGramTable):
    raise InputError("ngram must be the device table (NGram.to_table()) or "
                     f"None; got {type(ngram).__name__}.")


def dart_search(logits: jax.Array, context: jax.Array,
                ngram: NGramTable | None, config: TreeConfig,
                d2t: jax.Array | None = None,
                context_len: jax.Array | None = None,
                context_ngram: ContextNGram | None = None) -> Tree:
  """Builds the DART draft tree for one round (jittable, vmappable).

  Args:
    logits: [D+1, Vd] draft-head logits, one row per level (finite).
    context: int32 [C] the last C committed tokens, ending with the root (the
      root token becomes node 0). C is static; only the last order-1 matter.
    ngram: `NGramTable` pytree, or None for no N-gram term.
    config: `TreeConfig` (static under jit).
    d2t: int32 [Vd] offsets, draft id i -> target id i + d2t[i]; None =
      identity.
    context_len: int32 [] how many trailing entries of `context` are real
      (the front is padding); None = all. Clipped to [1, C].
    context_ngram: the sequence's own `ContextNGram` (one row), mixed into the
      N-gram term; None = the reference search. Needs C >= its max_order - 1.

  Returns:
    `Tree` with N = config.remain_total and D+2 path columns; see
    `dart_jax.tree.structure` for the conventions.
  """
  _check_inputs(logits, context, ngram, config, d2t, context_len)
  tokens, log_probs = level_candidates(logits, config, d2t)
  return search_candidates(tokens, log_probs, context, ngram, config,
                           context_len, context_ngram)
