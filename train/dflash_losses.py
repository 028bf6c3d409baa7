"""The DFlash and Domino training objectives (``docs/algorithms.md``, "Training").

One packed row of T tokens (x_p, loss_mask, segment ids) trains many blocks at
once, in one pass of the frozen target and one masked pass of the drafter:

- Target pass: the outputs of ``target_layer_ids`` at every row give the taps
  ``[B, T, n*Ht]`` (no LM head: the labels are the data's tokens).
- Anchors: ``num_anchors`` positions per row, drawn at random among those whose
  next token is a training target in the same segment (``losses.choose_anchors``).
- Block j (anchor a): input ids ``[x_a, MASK x (B-1)]`` embedded with the
  target's table, at positions a .. a+B-1; slot k (1..B-1) predicts x_{a+k}.
  Valid (block, slot) pairs: x_{a+k} is a training target of a's segment.
- Mask (``dflash_block_mask`` restricted to the anchor's segment): block j sees
  the context rows p < a of its segment and its own B tokens bidirectionally,
  no other block. That is exactly what inference computes for the root x_a
  after committing x_0 .. x_{a-1} (tested). RoPE uses row indices for both the
  context and the blocks; attention only sees position differences, which equal
  those of the per-segment positions.
- Base logits: the target's lm_head (without its final norm) on the drafter's
  normed outputs of slots 1..B-1: ``[B, A, D, V]``, D = B-1.
- Loss: cross-entropy against the data's tokens, slot k weighted
  ``w_k = exp(-(k-1)/gamma)``, normalised over the valid pairs:
  ``CE_w = sum(w * ce * valid) / sum(w * valid)``.
- Domino: the GRU runs teacher-forced over the ground-truth block
  (``s_0 = GRU(embed(x_a), 0)``, ``s_k = GRU(embed(x_{a+k}), s_{k-1})``) and
  slot k's corrected logits are
  ``base_k + W2 . SiLU(W_z hid_k + W_s s_{k-1})``; the loss is
  ``(1-l) * CE_w(corrected) + l * CE_w(base)`` with l decayed linearly 1 -> 0
  over the first ``anneal_steps`` steps (``domino_lambda``).
- Metrics per slot: cross-entropy and top-1 accuracy of the logits drafts are
  made with (corrected for Domino, teacher-forced) and of the base logits, and
  the estimated acceptance length ``1 + sum_k prod_{j<=k} acc_j``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dart_jax.draft.dflash import dflash_block_mask
from train import losses

# DFlash's published gamma per block size; others get (B-1)/2.
_GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


class BlockStats(NamedTuple):
  """Sums over a batch, one entry per block slot [D] (add across batches, then divide).

  ce_sum / correct: of the logits drafts are made with (Domino: corrected);
  base_ce_sum / base_correct: of the backbone's base logits;
  base_in_topk: the label is among the base logits' top ``CANDIDATE_TOPK``, i.e.
    in DARTree's candidate table, which bounds what a tree can accept.
  """

  ce_sum: jax.Array
  correct: jax.Array
  base_ce_sum: jax.Array
  base_correct: jax.Array
  count: jax.Array
  base_in_topk: jax.Array


# DARTree's candidate table: the top-K of the base logits per slot (the shipped
# SmolLM2 tree's K; the spec's default is 64).
CANDIDATE_TOPK = 32


def default_gamma(block_size: int) -> float:
  """DFlash's position-decay gamma for a block size."""
  return _GAMMA_BY_BLOCK_SIZE.get(block_size, max((block_size - 1) / 2.0, 1.0))


def position_weights(num_depths: int, gamma: float) -> np.ndarray:
  """w_k = exp(-(k-1)/gamma) for slots k = 1..D: [D] float32 (gamma=inf: ones)."""
  k = np.arange(1, num_depths + 1, dtype=np.float64)
  return np.exp(-(k - 1) / gamma).astype(np.float32)


def domino_lambda(step: jax.Array, anneal_steps: int, floor: float = 0.0) -> jax.Array:
  """l(step) = max(floor, 1 - step / anneal_steps); ``floor`` throughout when
  anneal_steps = 0."""
  if anneal_steps <= 0:
    return jnp.full((), floor, jnp.float32)
  return jnp.clip(1.0 - jnp.asarray(step, jnp.float32) / anneal_steps, floor, 1.0)


def block_targets(loss_mask: jax.Array, segment_ids: jax.Array, num_depths: int
                  ) -> jax.Array:
  """valid[b, a, k-1]: x_{a+k} is a training target in a's segment (k = 1..D).

  loss_mask, segment_ids: [B, T] -> [B, T, D] bool.
  """
  batch, length = loss_mask.shape

  def ahead(x, k):
    return jnp.concatenate([x[:, k:], jnp.zeros((batch, k), x.dtype)], axis=1)[:, :length]

  out = [ahead(loss_mask, k) & (ahead(segment_ids, k) == segment_ids) & (segment_ids > 0)
         for k in range(1, num_depths + 1)]
  return jnp.stack(out, axis=-1)


def block_inputs(tokens: jax.Array, anchors: jax.Array, block_size: int,
                 mask_token_id: int) -> jax.Array:
  """``[x_a, MASK x (B-1)]`` per anchor: tokens [B, T], anchors [B, A] -> [B, A*B]."""
  roots = jnp.take_along_axis(tokens, anchors, axis=1).astype(jnp.int32)
  ids = jnp.full(anchors.shape + (block_size,), mask_token_id, jnp.int32)
  return ids.at[:, :, 0].set(roots).reshape(anchors.shape[0], -1)


def block_labels(tokens: jax.Array, anchors: jax.Array, num_depths: int) -> jax.Array:
  """x_{a+k} for k = 1..D (clipped at the row end): [B, A, D] int32."""
  batch, length = tokens.shape
  rows = jnp.minimum(anchors[:, :, None] + jnp.arange(1, num_depths + 1), length - 1)
  labels = jnp.take_along_axis(tokens, rows.reshape(batch, -1), axis=1)
  return labels.reshape(anchors.shape + (num_depths,)).astype(jnp.int32)


def training_mask(segment_ids: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
  """DFlash's block mask with the context limited to the anchor's segment.

  segment_ids: [B, T]; anchors: [B, A]. Returns [B, A*B, T + A*B] bool (block
  tokens block-major): block j sees rows p < anchor_j of its segment and itself.
  """
  length = segment_ids.shape[1]
  mask = dflash_block_mask(anchors, length, block_size)
  anchor_seg = jnp.repeat(jnp.take_along_axis(segment_ids, anchors, axis=1), block_size,
                          axis=1)  # [B, A*B]
  same_segment = segment_ids[:, None, :] == anchor_seg[:, :, None]
  return jnp.concatenate([mask[:, :, :length] & same_segment, mask[:, :, length:]], axis=-1)


def target_taps(target_model, batch: dict, taps: tuple[int, ...], *,
                attn_impl: str = "xla") -> jax.Array:
  """The frozen target's layer outputs over packed rows: [B, T, n*Ht], no gradient."""
  tokens = batch["tokens"]
  mask = losses.target_attention_mask(batch["segment_ids"])
  out = target_model(tokens, batch["positions"], None, mask, taps=tuple(taps),
                     logit_rows=jnp.zeros((tokens.shape[0], 0), jnp.int32),
                     attn_impl=attn_impl)
  return jax.lax.stop_gradient(out.taps)


def draft_base(drafter, target_model, taps: jax.Array, tokens: jax.Array,
               segment_ids: jax.Array, anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The backbone's drafts for every block.

  drafter: a ``DFlashModule``; taps: [B, T, n*Ht]; tokens, segment_ids: [B, T];
  anchors: [B, A]. Returns (base_logits [B, A, D, V] float32, hidden
  [B, A, D, H] normed outputs of slots 1..B-1).
  """
  c = drafter.config
  batch, num_anchors = anchors.shape
  block = c.block_size
  ids = block_inputs(tokens, anchors, block, c.mask_token_id)
  embeds = jax.lax.stop_gradient(target_model.embed(ids))
  positions = (anchors[:, :, None] + jnp.arange(block)).reshape(batch, -1)
  mask = training_mask(segment_ids, anchors, block)
  # Cached taps may be stored narrower (float16) than the target computes.
  hidden = drafter.forward_masked(taps.astype(embeds.dtype), embeds, positions, mask)
  hidden = hidden.reshape(batch, num_anchors, block, -1)[:, :, 1:]
  return target_model.lm_head_logits(hidden), hidden  # no final norm: DFlash's own


def teacher_forced_logits(drafter, embed_table: jax.Array, base_logits: jax.Array,
                          hidden: jax.Array, roots: jax.Array, labels: jax.Array
                          ) -> jax.Array:
  """Domino's corrected logits along the ground-truth path of every block.

  base_logits: [B, A, D, V]; hidden: [B, A, D, H]; roots: [B, A]; labels:
  [B, A, D] (x_{a+1} .. x_{a+D}). Slot k uses the GRU state after the root and
  x_{a+1} .. x_{a+k-1}. Returns [B, A, D, V] float32.
  """
  head = drafter.correction_head(embed_table, hidden)  # z: [B, A, D, E]
  depths = labels.shape[-1]
  inputs = jnp.concatenate([roots[..., None], labels[..., :-1]], axis=-1)  # [B, A, D]
  flat = inputs.reshape(-1, depths).T  # [D, F]

  def step(state, tokens):
    state = head.gru(tokens, state)
    return state, state

  init = jnp.zeros((flat.shape[1], head.state_size), jnp.float32)
  _, states = jax.lax.scan(step, init, flat)  # [D, F, G]
  states = jnp.moveaxis(states, 0, 1).reshape(labels.shape + (head.state_size,))
  bias = jax.nn.silu(head.z + states @ head.w_state) @ head.w_out  # [B, A, D, V]
  corrected = jnp.arange(depths) >= head.num_uncorrected  # pure-draft prefix slots
  return base_logits.astype(jnp.float32) + bias * corrected[:, None]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-position CE in float32: logits [..., V], labels [...] -> [...]."""
  logits = logits.astype(jnp.float32)
  gold = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - gold


def weighted_ce(ce: jax.Array, valid: jax.Array, weights: jax.Array) -> jax.Array:
  """``sum(w * ce * valid) / sum(w * valid)``: ce, valid [B, A, D]; weights [D]."""
  w = valid.astype(jnp.float32) * weights
  return jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)


def block_loss(base_logits: jax.Array, corrected_logits: jax.Array | None,
               labels: jax.Array, valid: jax.Array, weights: jax.Array,
               lam: jax.Array | float = 0.0) -> tuple[jax.Array, BlockStats]:
  """The DFlash loss (``corrected_logits`` None) or Domino's mix.

  base_logits, corrected_logits: [B, A, D, V]; labels: [B, A, D]; valid:
  [B, A, D] bool; weights: [D]; lam: Domino's l. Returns (loss, BlockStats).
  """
  v = valid.astype(jnp.float32)
  base_ce = cross_entropy(base_logits, labels)
  base_hit = (jnp.argmax(base_logits, axis=-1) == labels).astype(jnp.float32)
  base_gold = jnp.take_along_axis(base_logits, labels[..., None], axis=-1)
  base_rank = jnp.sum(base_logits > base_gold, axis=-1)
  base_in_topk = (base_rank < CANDIDATE_TOPK).astype(jnp.float32)
  loss = weighted_ce(base_ce, valid, weights)
  ce, hit = base_ce, base_hit
  if corrected_logits is not None:
    ce = cross_entropy(corrected_logits, labels)
    hit = (jnp.argmax(corrected_logits, axis=-1) == labels).astype(jnp.float32)
    loss = (1.0 - lam) * weighted_ce(ce, valid, weights) + lam * loss
  total = lambda x: jnp.sum(x * v, axis=(0, 1))
  return loss, BlockStats(total(ce), total(hit), total(base_ce), total(base_hit),
                          jnp.sum(v, axis=(0, 1)), total(base_in_topk))


def forward(drafter, target_model, batch: dict, key: jax.Array, *, num_anchors: int,
            weights: jax.Array, lam: jax.Array | float = 0.0,
            attn_impl: str = "xla") -> tuple[jax.Array, BlockStats]:
  """Loss and per-slot stats of one batch (drafter parameters differentiable).

  drafter: a ``DFlashModule`` (Domino head used when it has one); batch: dict
  of [B, T] arrays (tokens, loss_mask, segment_ids, positions); weights: [D].
  """
  c = drafter.config
  tokens = batch["tokens"]
  valid = block_targets(batch["loss_mask"], batch["segment_ids"], c.num_depths)
  anchors, pair_valid = losses.choose_anchors(key, valid, num_anchors)
  # Cached features (``train/features.py``) carry the taps; else the target runs.
  taps = (batch["taps"] if "taps" in batch
          else target_taps(target_model, batch, c.taps, attn_impl=attn_impl))
  base, hidden = draft_base(drafter, target_model, taps, tokens, batch["segment_ids"],
                            anchors)
  labels = block_labels(tokens, anchors, c.num_depths)
  corrected = None
  if c.domino:
    embed_table = jax.lax.stop_gradient(target_model.embed_tokens.embedding[...])
    roots = jnp.take_along_axis(tokens, anchors, axis=1).astype(jnp.int32)
    corrected = teacher_forced_logits(drafter, embed_table, base, hidden, roots, labels)
  return block_loss(base, corrected, labels, pair_valid, weights, lam)


def summarize(stats: BlockStats, weights: np.ndarray, domino: bool) -> dict[str, Any]:
  """Per-slot CE and accuracy, the weighted CE of the drafting logits ("loss"),
  and the estimated acceptance length ``1 + sum_k prod_{j<=k} acc_j`` (host side,
  from summed stats); Domino adds the same for the base logits, and the base
  top-``CANDIDATE_TOPK`` recall per slot with the acceptance bound it puts on a
  DARTree tree (``accept_len_candidates``, the same formula)."""
  ce_sum, correct, base_ce_sum, base_correct, count, base_in_topk = (
      np.asarray(x, np.float64) for x in stats)
  safe = np.maximum(count, 1.0)
  w = np.asarray(weights, np.float64)
  norm = max(float(np.sum(w * count)), 1e-9)

  def part(ce_total, hits):
    acc = hits / safe
    return (float(np.sum(w * ce_total) / norm), [float(x) for x in ce_total / safe],
            [float(x) for x in acc], float(1.0 + np.sum(np.cumprod(acc))))

  loss, ce, acc, accept_len = part(ce_sum, correct)
  out = {"loss": loss, "ce": ce, "acc": acc, "accept_len": accept_len,
         "targets": [int(x) for x in count]}
  if domino:
    loss_b, ce_b, acc_b, accept_b = part(base_ce_sum, base_correct)
    recall = base_in_topk / safe
    out.update(loss_base=loss_b, ce_base=ce_b, acc_base=acc_b, accept_len_base=accept_b,
               recall_base=[float(x) for x in recall],
               accept_len_candidates=float(1.0 + np.sum(np.cumprod(recall))))
  return out


def resolve_gamma(gamma: float, block_size: int) -> float:
  """``loss.position_gamma`` -> the gamma used (0 = by block size)."""
  return default_gamma(block_size) if gamma == 0 else float(gamma)
