"""DARTree tree builders and their baselines (``docs/algorithms.md``, "DARTree").

All builders take one round's drafter output for ONE sequence (vmap them over
the batch) and return the same padded ``Tree`` the verifier consumes:

- ``dartree`` (pruned, default): a fixed-width supertree, ``supertree_width``
  pairs kept per depth, then the global best ``budget`` nodes by
  ``path + depth_bonus * depth``.
- ``dartree-fixed``: per depth the best ``quota = ceil(remaining budget /
  remaining depths)`` pairs; every built node is verified.
- ``ddtree``: best-first over the UNcorrected marginals. Marginals do not
  depend on the path, so the best-first tree of ``budget`` nodes equals the
  global best ``budget`` nodes by path score, which a beam of width ``budget``
  per depth contains: the same machinery with width = budget, no correction,
  no depth bonus.
- ``dflash-chain``: the argmax of each depth's base logits.
- ``domino-chain``: sequential greedy decoding with the correction head over
  the full vocabulary (Domino's own drafting).

One depth of the tree methods is ONE batched call over the frontier: the
corrected logits of every (parent, candidate) pair, a log-softmax over the K
candidates, path scores, one top-k over the [F*K] pairs, and a batched GRU
advance of the kept pairs. Shapes are static (they follow from the config, D
and V only).

Tie-breaking (the numpy reference uses the same rules): candidates of a depth
by logit descending, then lower token id; pairs of a depth by path score
descending, then lower flat index ``parent_rank * K + candidate_rank``; the
final cut by key descending, then lower record index (records are stored depth
by depth, rank order within a depth). A child's key never exceeds its parent's
(log-probs <= 0, depth_bonus <= 0) and its record index is larger, so the
kept set is prefix-closed even under ties. Nodes are in BFS order: by depth,
then by rank within the depth. Children of a node carry distinct tokens (the
K candidates of a depth are distinct), as ``accept_tree`` requires.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from dart_jax.draft.correction import CorrectionHead
from dart_jax.errors import ConfigError, InputError
from dart_jax.tree.dart_search import exact_top_k
from dart_jax.tree.structure import Tree, build_tree

TREE_METHODS = ("dartree", "dartree-fixed", "ddtree", "dflash-chain", "domino-chain")
CORRECTED_METHODS = ("dartree", "dartree-fixed", "domino-chain")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DARTreeConfig:
  """Tree-shape settings of the DARTree methods (defaults = the paper's).

  Hashable and static, so it can be a static jit argument. The block size
  (depths D = B-1) comes from the drafter.

  Attributes:
    topk: K, candidates per depth (top-K of the base logits; capped at V).
    supertree_width: pairs kept per depth by the pruned variant.
    budget: B_tree, draft nodes verified per round (root excluded); also the
      DDTree node budget and the fixed variant's total.
    depth_bonus: added per depth to the pruned variant's final ranking key;
      must be <= 0 (keeps the selection prefix-closed).
  """

  topk: int = 64
  supertree_width: int = 12
  budget: int = 64
  depth_bonus: float = -0.2

  def __post_init__(self):
    for name in ("topk", "supertree_width", "budget"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"DARTreeConfig.{name} must be an int >= 1, got {value!r}")
    if not isinstance(self.depth_bonus, (int, float)) or not self.depth_bonus <= 0:
      raise ConfigError(f"DARTreeConfig.depth_bonus must be <= 0 (a positive bonus "
                        f"would rank children above their parents and break prefix "
                        f"closure), got {self.depth_bonus!r}")


def resolve_method(tree: str, has_head: bool) -> str:
  """Checks a method name; "chain" means the Domino chain with a head, else DFlash's."""
  if tree == "chain":
    return "domino-chain" if has_head else "dflash-chain"
  if tree not in TREE_METHODS:
    raise ConfigError(f"unknown DARTree method tree={tree!r}; choose one of "
                      f"{', '.join(('chain',) + TREE_METHODS)}")
  if tree in CORRECTED_METHODS and not has_head:
    raise ConfigError(f"tree={tree!r} needs the Domino correction head, but this "
                      "drafter is plain DFlash; use 'ddtree' or 'chain', or load a "
                      "Domino drafter")
  return tree


def level_widths(method: str, config: DARTreeConfig, num_depths: int,
                 vocab: int) -> tuple[int, ...]:
  """Nodes kept at each depth (static), for the tree methods."""
  k = min(config.topk, vocab)
  widths, frontier, remaining = [], 1, config.budget
  for d in range(num_depths):
    available = frontier * k
    if method == "dartree-fixed":
      width = min(math.ceil(remaining / (num_depths - d)), available)
      remaining -= width
    elif method == "dartree":
      width = min(config.supertree_width, available)
    elif method == "ddtree":
      width = min(config.budget, available)
    else:
      raise ConfigError(f"level_widths: {method!r} is not a tree method")
    if width < 1:
      break  # The fixed budget is spent: no deeper levels.
    widths.append(width)
    frontier = width
  return tuple(widths)


def num_tree_nodes(method: str, config: DARTreeConfig, num_depths: int, vocab: int) -> int:
  """N, the draft nodes of every tree a method builds (static)."""
  if method in ("dflash-chain", "domino-chain"):
    return num_depths
  total = sum(level_widths(method, config, num_depths, vocab))
  return total if method == "dartree-fixed" else min(config.budget, total)


def _check_inputs(base_logits: jax.Array, head: CorrectionHead | None, method: str,
                  d2t: jax.Array | None):
  if base_logits.ndim != 2:
    raise InputError(f"base_logits must be [D, V] (vmap over the batch), got shape "
                     f"{base_logits.shape}")
  if d2t is not None and d2t.shape != base_logits.shape[-1:]:
    raise InputError(f"d2t must have one offset per logit column, got shape {d2t.shape} "
                     f"for base_logits {base_logits.shape}")
  if method in CORRECTED_METHODS:
    if head is None:
      raise InputError(f"method {method!r} needs a CorrectionHead")
    if head.z.shape[-2] != base_logits.shape[0]:
      raise InputError(f"CorrectionHead.z has {head.z.shape[-2]} depth rows, "
                       f"base_logits {base_logits.shape[0]}")
    if head.w_out.shape[-1] != base_logits.shape[1]:
      raise InputError(f"CorrectionHead.w_out has {head.w_out.shape[-1]} output columns, "
                       f"base_logits {base_logits.shape[1]}: they must share a vocabulary")


def _expand(cand_ids, cand_tokens, cand_logits, cand_embed, z, depth, path, state, head,
            width):
  """One depth: score every (frontier node, candidate) pair, keep the best ``width``.

  cand_ids: [K] this depth's candidates as logit columns (the correction's
  vocabulary); cand_tokens: [K] the same as target ids; cand_logits: [K];
  cand_embed: [K, H] their float32 target embeddings (or [K, 0] without a
  head); z: [E] or None; depth: 0-based depth row (may be traced); path: [F];
  state: [F, G] or None.
  Returns (tokens [W], parent rank [W], path [W], state of the kept [W, G]).
  """
  k = cand_tokens.shape[0]
  logits = jnp.broadcast_to(cand_logits[None, :], (path.shape[0], k))
  if head is not None:
    bias = head.bias(z, state, cand_ids)
    logits = logits + jnp.where(depth >= head.num_uncorrected, bias, 0.0)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  top, flat = lax.top_k((path[:, None] + log_probs).reshape(-1), width)
  parent, cand = flat // k, flat % k
  tokens = cand_tokens[cand]
  if head is not None:
    state = head.gru_on(cand_embed[cand], state[parent])
  return tokens, parent, top, state


def _segments(widths: tuple[int, ...]) -> list[tuple[int, int]]:
  """Splits depths into (start, stop) runs; a run of depths whose frontier keeps
  the same width is one ``lax.scan`` (compile time does not grow with D)."""
  segments, d = [], 0
  while d < len(widths):
    stop = d + 1
    if d > 0:
      while stop < len(widths) and widths[stop] == widths[d] == widths[d - 1]:
        stop += 1
    segments.append((d, stop))
    d = stop
  return segments


def _grow(cand_ids: jax.Array, cand_tokens: jax.Array, cand_logits: jax.Array,
          root: jax.Array, head: CorrectionHead | None, widths: tuple[int, ...]):
  """Depth-by-depth expansion; returns per-record (tokens, parent, depth, path).

  cand_ids, cand_tokens, cand_logits: [D, K] candidates as logit columns, as
  target ids, and their base logits.

  Records are stored depth by depth in rank order; ``parent`` is a node index
  in that numbering with the root as 0 and record r as r+1.
  """
  path = jnp.zeros((1,), jnp.float32)
  state = head.root_state(root)[None] if head is not None else None
  z = head.z if head is not None else jnp.zeros((len(widths), 0), jnp.float32)
  # The candidates' embeddings are gathered once, outside the depth loop: with
  # the (bf16) table inside the loop, XLA:CPU hoists a float32 conversion of
  # the whole table out of it, 113 MB per round for SmolLM2 (~35 ms).
  cand_embed = (head.embed_rows(cand_tokens) if head is not None
                else jnp.zeros(cand_tokens.shape + (0,), jnp.float32))
  tokens, parents, paths = [], [], []
  for start, stop in _segments(widths):
    if stop - start == 1:
      tok, par, path, state = _expand(cand_ids[start], cand_tokens[start],
                                      cand_logits[start], cand_embed[start], z[start],
                                      start, path, state, head, widths[start])
      tokens.append(tok)
      parents.append(par[None])
      paths.append(path)
      continue

    def body(carry, xs, width=widths[start]):
      path, state = carry
      tok, par, path, state = _expand(*xs, path, state, head, width)
      return (path, state), (tok, par, path)

    xs = (cand_ids[start:stop], cand_tokens[start:stop], cand_logits[start:stop],
          cand_embed[start:stop], z[start:stop], jnp.arange(start, stop))
    (path, state), (tok, par, run_paths) = lax.scan(body, (path, state), xs)
    tokens.append(tok.reshape(-1))
    parents.append(par)
    paths.append(run_paths.reshape(-1))
  # Parent ranks -> node indices: depth d's frontier starts at node
  # 1 + sum(widths[:d-1]) (the root is node 0).
  starts = [0] + [1 + sum(widths[:d - 1]) for d in range(1, len(widths))]
  parents = jnp.concatenate(
      [(p + jnp.asarray(starts[i:i + p.shape[0]], jnp.int32)[:, None]).reshape(-1)
       for i, p in zip([s for s, _ in _segments(widths)], parents)])
  depths = jnp.concatenate([jnp.full((w,), d + 1, jnp.int32) for d, w in enumerate(widths)])
  return (jnp.concatenate(tokens), parents.astype(jnp.int32), depths,
          jnp.concatenate(paths))


def _tree(root, tokens, parents, depths, paths, num_depths) -> Tree:
  n = tokens.shape[0]
  return build_tree(
      tokens=jnp.concatenate([root[None].astype(jnp.int32), tokens.astype(jnp.int32)]),
      parents=jnp.concatenate([jnp.full((1,), -1, jnp.int32), parents]),
      depth=jnp.concatenate([jnp.zeros((1,), jnp.int32), depths]),
      scores=jnp.concatenate([jnp.zeros((1,), jnp.float32), paths]),
      num_nodes=jnp.asarray(n, jnp.int32), max_depth=num_depths)


def _select(tokens, parents, depths, paths, keep: int, depth_bonus: float):
  """Global best ``keep`` records by ``path + depth_bonus * depth``, in BFS order."""
  records = tokens.shape[0]
  key = paths + jnp.float32(depth_bonus) * depths.astype(jnp.float32)
  _, chosen = lax.top_k(key, keep)
  chosen = jnp.sort(chosen)  # records are depth-major: index order is BFS order
  new_index = jnp.zeros((records + 1,), jnp.int32).at[chosen + 1].set(
      jnp.arange(1, keep + 1, dtype=jnp.int32))
  return (tokens[chosen], new_index[parents[chosen]], depths[chosen], paths[chosen])


def dartree_build(base_logits: jax.Array, root: jax.Array,
                  head: CorrectionHead | None = None,
                  config: DARTreeConfig = DARTreeConfig(), *,
                  method: str = "dartree", d2t: jax.Array | None = None) -> Tree:
  """Builds one round's draft tree for one sequence.

  Args:
    base_logits: [D, V] the backbone's logits; row d-1 is depth d.
    root: int32 [] the root token (last committed token, a target id).
    head: the Domino correction head with ``z [D, E]`` and ``w_out [E, V]`` over
      the same V columns as ``base_logits`` (unused by "ddtree" and
      "dflash-chain"); its GRU embeds target ids.
    config: tree-shape settings.
    method: one of ``TREE_METHODS``.
    d2t: int32 [V] offsets when the logit columns are a reduced draft
      vocabulary (column i is target id ``i + d2t[i]``, as DART heads store
      it); None = the columns are target ids. Tree tokens are target ids.
  Returns:
    A ``Tree`` with N = ``num_tree_nodes(method, config, D, V)`` nodes (all
    valid), max depth D.
  """
  _check_inputs(base_logits, head, method, d2t)
  num_depths, vocab = base_logits.shape
  base_logits = base_logits.astype(jnp.float32)
  root = jnp.asarray(root, jnp.int32)
  to_target = ((lambda ids: ids) if d2t is None
               else lambda ids: ids + jnp.asarray(d2t, jnp.int32)[ids])
  if method == "dflash-chain":
    return _dflash_chain(base_logits, root, to_target)
  if method == "domino-chain":
    return _domino_chain(base_logits, root, head, to_target)
  widths = level_widths(method, config, num_depths, vocab)
  cand_logits, cand_ids = exact_top_k(base_logits, min(config.topk, vocab))
  records = _grow(cand_ids, to_target(cand_ids), cand_logits, root,
                  head if method in CORRECTED_METHODS else None, widths)
  if method != "dartree-fixed":
    keep = num_tree_nodes(method, config, num_depths, vocab)
    bonus = config.depth_bonus if method == "dartree" else 0.0
    records = _select(*records, keep, bonus)
  return _tree(root, *records, num_depths)


def _chain(root, tokens, log_probs, num_depths) -> Tree:
  index = jnp.arange(num_depths, dtype=jnp.int32)
  return _tree(root, tokens, index, index + 1, jnp.cumsum(log_probs), num_depths)


def _dflash_chain(base_logits: jax.Array, root: jax.Array, to_target) -> Tree:
  ids = jnp.argmax(base_logits, axis=-1).astype(jnp.int32)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(base_logits, axis=-1),
                                  ids[:, None], axis=1)[:, 0]
  return _chain(root, to_target(ids), log_probs, base_logits.shape[0])


def _domino_chain(base_logits: jax.Array, root: jax.Array, head: CorrectionHead,
                  to_target) -> Tree:
  """Domino's sequential drafting: argmax of the corrected logits, GRU advance."""
  state = head.root_state(root)
  tokens, log_probs = [], []
  num_depths = base_logits.shape[0]
  for d in range(num_depths):
    logits = base_logits[d]
    if d >= head.num_uncorrected:
      logits = logits + head.full_bias(d, state)
    column = jnp.argmax(logits).astype(jnp.int32)
    log_probs.append(jax.nn.log_softmax(logits)[column])
    token = to_target(column)
    tokens.append(token)
    if d + 1 < num_depths:
      state = head.gru(token[None], state[None])[0]
  return _chain(root, jnp.stack(tokens), jnp.stack(log_probs), num_depths)
