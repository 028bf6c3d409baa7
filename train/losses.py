"""The DART training objective (``docs/algorithms.md``, "Training").

One row of T real positions (tokens x_p, target taps h_p) trains many anchors
at once. Layout of the head's attention rows: the T real rows first, then D
mask rows per anchor (anchor-major):

  real row p:      in = [input_layernorm(embed(x_{p+1})), hidden_norm(fc(h_p))],
                   residual fc(h_p), RoPE position pos_p
  mask row (a, k): in = mask_rep, residual mask_rep[:H], RoPE position pos_a + k
                   (k = 1..D)

Attention ("prefix-isolated" mask): real rows are causal within their packed
segment; the mask rows of anchor a see the real rows <= a of a's segment and
the mask rows (a, k' <= k) of the same anchor only. This is exactly what the
head computes at inference for the prefix x_0..x_{a+1} (``DartHeadModule.__call__``
with real rows 0..a followed by D mask rows), so every anchor costs D rows
instead of a separate pass.

Level 0 of anchor a is read from real row a and predicts x_{a+2}; level k from
mask row (a, k) and predicts x_{a+2+k}. Its teacher is the frozen target's
distribution at row a+1+k (which predicts the same token). The loss per level is
KL(teacher || draft) over the draft vocabulary: the teacher's logits are
gathered at the draft ids (``i + d2t[i]``) and renormalised there (a softmax over
the Vd kept logits, as EAGLE-3 does). Levels are weighted ``level_decay ** k``
and each level is averaged over its valid (anchor, level) pairs: the predicted
token is a training target (assistant token) in the anchor's segment.

Metrics per level: top-1 accuracy (the draft argmax mapped to a target id
equals the target's argmax over the FULL vocabulary) and an estimated
acceptance length ``1 + sum_k prod_{j<=k} acc_j``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dart_jax.models import layers


class LevelStats(NamedTuple):
  """Sums over a batch, one entry per level [D+1] (add across batches, then divide)."""

  kl_sum: jax.Array
  correct: jax.Array
  count: jax.Array


def level_targets(loss_mask: jax.Array, segment_ids: jax.Array, num_levels: int) -> jax.Array:
  """valid[b, a, k]: anchor a has a target at level k, i.e. x_{a+2+k} is a
  training target in a's segment. loss_mask, segment_ids: [B, T] -> [B, T, K] bool."""
  batch, length = loss_mask.shape
  out = []
  for k in range(num_levels):
    shift = 2 + k
    pad = jnp.zeros((batch, shift), bool)
    target = jnp.concatenate([loss_mask[:, shift:], pad], axis=1)[:, :length]
    seg_ahead = jnp.concatenate([segment_ids[:, shift:], jnp.zeros((batch, shift),
                                                                  segment_ids.dtype)], 1)
    out.append(target & (seg_ahead[:, :length] == segment_ids) & (segment_ids > 0))
  return jnp.stack(out, axis=-1)


def choose_anchors(key: jax.Array, valid: jax.Array, num_anchors: int
                   ) -> tuple[jax.Array, jax.Array]:
  """Anchors per row: ``num_anchors`` positions drawn uniformly among those with a
  target (others only if there are too few), sorted; 0 = every position.

  valid: [B, T, K]. Returns (anchors [B, A] int32, weights [B, A, K] bool).
  """
  batch, length, _ = valid.shape
  if num_anchors <= 0 or num_anchors >= length:
    anchors = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  else:
    has_target = valid.any(-1)
    # Positions with a target score in [1, 2), the rest in [0, 1).
    score = jax.random.uniform(key, (batch, length)) + has_target
    _, anchors = jax.lax.top_k(score, num_anchors)
    anchors = jnp.sort(anchors, axis=-1).astype(jnp.int32)
  weights = jnp.take_along_axis(valid, anchors[:, :, None], axis=1)
  return anchors, weights


def target_attention_mask(segment_ids: jax.Array) -> jax.Array:
  """Causal within packed segments. segment_ids [B, T] -> [B, T, T] bool."""
  length = segment_ids.shape[1]
  idx = jnp.arange(length)
  causal = idx[:, None] >= idx[None, :]
  return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def head_attention_mask(segment_ids: jax.Array, anchors: jax.Array,
                        draft_length: int) -> jax.Array:
  """The prefix-isolated mask over [T real rows ++ A*D mask rows].

  segment_ids: [B, T]; anchors: [B, A]. Returns [B, N, N] bool, N = T + A*D:
  real rows causal within their segment and blind to mask rows; mask row
  (a, k) sees real rows <= a of a's segment and mask rows (a, 1..k).
  """
  batch, length = segment_ids.shape
  num_anchors = anchors.shape[1]
  d = draft_length
  real_real = target_attention_mask(segment_ids)
  idx = jnp.arange(length)
  anchor_seg = jnp.take_along_axis(segment_ids, anchors, axis=1)
  mask_real = ((idx[None, None, :] <= anchors[:, :, None])
               & (segment_ids[:, None, :] == anchor_seg[:, :, None]))  # [B, A, T]
  mask_real = jnp.repeat(mask_real, d, axis=1)  # [B, A*D, T]
  r = jnp.arange(num_anchors * d)
  mask_mask = (r[:, None] // d == r[None, :] // d) & (r[None, :] % d <= r[:, None] % d)
  top = jnp.concatenate([real_real, jnp.zeros((batch, length, num_anchors * d), bool)], -1)
  bottom = jnp.concatenate(
      [mask_real, jnp.broadcast_to(mask_mask, (batch,) + mask_mask.shape)], -1)
  return jnp.concatenate([top, bottom], axis=1)


def head_rows(head, next_embeds: jax.Array, taps: jax.Array, positions: jax.Array,
              anchors: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Attention inputs, residuals and RoPE positions of all N = T + A*D rows.

  head: a ``DartHeadModule``; next_embeds: [B, T, H] embeddings of x_{p+1};
  taps: [B, T, 3Ht]; positions: [B, T]; anchors [B, A].
  Returns (attn_in [B, N, 2H], residual [B, N, H], positions [B, N]).
  """
  batch = taps.shape[0]
  d = head.config.draft_length
  num_mask = anchors.shape[1] * d
  attn_real, res_real = head.real_rows(taps, next_embeds)
  rep_in, rep_res = head.mask_rows()
  attn_in = jnp.concatenate([attn_real, jnp.broadcast_to(
      rep_in.astype(attn_real.dtype), (batch, num_mask, rep_in.shape[-1]))], axis=1)
  residual = jnp.concatenate([res_real, jnp.broadcast_to(
      rep_res.astype(res_real.dtype), (batch, num_mask, rep_res.shape[-1]))], axis=1)
  anchor_pos = jnp.take_along_axis(positions, anchors, axis=1)
  mask_pos = (anchor_pos[:, :, None] + jnp.arange(1, d + 1)[None, None, :]).reshape(batch, -1)
  return attn_in, residual, jnp.concatenate([positions, mask_pos], axis=1)


def draft_logits(head, next_embeds: jax.Array, taps: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array, anchors: jax.Array, *,
                 attn_impl: str = "xla") -> jax.Array:
  """The head's drafts for every anchor: [B, A, D+1, Vd] float32.

  Row (a, 0) comes from real row a, rows (a, k) from mask slot k (see module doc).
  """
  return head.logits(draft_hidden(head, next_embeds, taps, positions, segment_ids,
                                  anchors, attn_impl=attn_impl))


def draft_hidden(head, next_embeds: jax.Array, taps: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array, anchors: jax.Array, *,
                 attn_impl: str = "xla") -> jax.Array:
  """What ``lm_head`` reads for ``draft_logits``: [B, A, D+1, H]."""
  batch, length, _ = taps.shape
  d = head.config.draft_length
  num_anchors = anchors.shape[1]
  attn_in, residual, all_pos = head_rows(head, next_embeds, taps, positions, anchors)
  mask = head_attention_mask(segment_ids, anchors, d)
  cos, sin = layers.rope_cos_sin(all_pos, head.inv_freq)
  attn, _, _ = head.midlayer.self_attn(attn_in, cos, sin, None, None, None, mask, None,
                                       attn_impl)
  h = residual + attn
  level0 = jnp.take_along_axis(h[:, :length], anchors[:, :, None], axis=1)
  masked = h[:, length:].reshape(batch, num_anchors, d, -1)
  return head.final_hidden(jnp.concatenate([level0[:, :, None], masked], axis=2))


def teacher_rows(anchors: jax.Array, num_levels: int, length: int) -> jax.Array:
  """Target rows whose logits teach each (anchor, level): a+1+k, clipped. [B, A*K]."""
  rows = anchors[:, :, None] + 1 + jnp.arange(num_levels)[None, None, :]
  return jnp.minimum(rows, length - 1).reshape(anchors.shape[0], -1)


def target_forward(target_model, batch: dict, anchors: jax.Array, tap_layers,
                   num_levels: int, *, attn_impl: str = "xla"
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Frozen target pass over packed rows.

  Returns (taps [B, T, 3Ht], teacher logits [B, A, K, V] float32, next_embeds
  [B, T, H]), all with gradients stopped.
  """
  tokens = batch["tokens"]
  bsz, length = tokens.shape
  mask = target_attention_mask(batch["segment_ids"])
  rows = teacher_rows(anchors, num_levels, length)
  out = target_model(tokens, batch["positions"], None, mask, taps=tuple(tap_layers),
                     logit_rows=rows, attn_impl=attn_impl)
  teacher = out.logits.reshape(bsz, anchors.shape[1], num_levels, -1)
  return (jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(teacher),
          _next_embeds(target_model, tokens))


class Teacher(NamedTuple):
  """What the frozen target teaches at each (anchor, level).

  logp: [..., Vd] float32 log-softmax of the target's logits at the draft ids
    (renormalised over the draft vocabulary: the KL's teacher).
  argmax: [...] int32 the target's argmax over the FULL vocabulary (accuracy).
  """

  logp: jax.Array
  argmax: jax.Array


def draft_target_ids(d2t: jax.Array) -> jax.Array:
  """[Vd] target id of each draft id: ``i + d2t[i]``."""
  return jnp.arange(d2t.shape[0]) + d2t.astype(jnp.int32)


def teacher_from_logits(logits: jax.Array, d2t: jax.Array) -> Teacher:
  """logits: [..., V] target logits; d2t: [Vd] offsets."""
  used = draft_target_ids(d2t)
  teacher_d = jnp.take(logits, used, axis=-1).astype(jnp.float32)
  return Teacher(jax.nn.log_softmax(teacher_d, axis=-1),
                 jnp.argmax(logits, axis=-1).astype(jnp.int32))


def target_features(target_model, batch: dict, anchors: jax.Array, tap_layers,
                    num_levels: int, d2t: jax.Array, *, attn_impl: str = "xla"
                    ) -> tuple[jax.Array, Teacher, jax.Array]:
  """(taps [B, T, 3Ht], Teacher at [B, A, K], next_embeds [B, T, H]) of a batch.

  From the batch's precomputed features when it carries them (``taps``,
  ``teacher_logp``, ``teacher_argmax``: see ``train/features.py``), else from a
  frozen target pass. Only the token embeddings of the target are read in the
  first case.
  """
  if "taps" not in batch:
    taps, logits, next_embeds = target_forward(target_model, batch, anchors, tap_layers,
                                               num_levels, attn_impl=attn_impl)
    return taps, teacher_from_logits(logits, d2t), next_embeds
  bsz, length = batch["tokens"].shape
  rows = teacher_rows(anchors, num_levels, length)
  shape = (bsz, anchors.shape[1], num_levels)
  logp = layers.gather_rows(batch["teacher_logp"], rows).astype(jnp.float32)
  argmax = jnp.take_along_axis(batch["teacher_argmax"], rows, axis=1)
  teacher = Teacher(logp.reshape(shape + logp.shape[-1:]), argmax.reshape(shape))
  next_embeds = _next_embeds(target_model, batch["tokens"])
  return batch["taps"].astype(next_embeds.dtype), teacher, next_embeds


def _next_embeds(target_model, tokens: jax.Array) -> jax.Array:
  """Embeddings of x_{p+1} (0 past the row's end). tokens [B, T] -> [B, T, H]."""
  next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  return jax.lax.stop_gradient(target_model.embed(next_tokens))


def dart_loss(draft: jax.Array, teacher: Teacher, weights: jax.Array, d2t: jax.Array,
              level_decay: float) -> tuple[jax.Array, LevelStats]:
  """KL(teacher || draft) per level over the draft vocabulary, decayed and summed.

  draft: [B, A, K, Vd]; teacher: at [B, A, K]; weights: [B, A, K] bool; d2t:
  [Vd] offsets. Returns (loss scalar, LevelStats sums [K]).
  """
  used = draft_target_ids(d2t)
  log_p = teacher.logp
  log_q = jax.nn.log_softmax(draft.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, A, K]
  w = weights.astype(jnp.float32)
  count = w.sum(axis=(0, 1))
  kl_sum = (kl * w).sum(axis=(0, 1))
  draft_ids = used[jnp.argmax(draft, axis=-1)]
  correct = (draft_ids == teacher.argmax).astype(jnp.float32)
  correct_sum = (correct * w).sum(axis=(0, 1))
  decay = level_decay ** jnp.arange(draft.shape[2], dtype=jnp.float32)
  loss = jnp.sum(decay * kl_sum / jnp.maximum(count, 1.0))
  return loss, LevelStats(kl_sum, correct_sum, count)


def summarize(stats: LevelStats, level_decay: float) -> dict[str, Any]:
  """Per-level KL and accuracy, the weighted loss, and the estimated acceptance
  length ``1 + sum_k prod_{j<=k} acc_j`` (host-side, from summed stats)."""
  kl_sum, correct, count = (np.asarray(x, np.float64) for x in stats)
  safe = np.maximum(count, 1.0)
  kl = kl_sum / safe
  acc = correct / safe
  decay = level_decay ** np.arange(len(kl))
  return {
      "loss": float(np.sum(decay * kl)),
      "kl": [float(x) for x in kl],
      "acc": [float(x) for x in acc],
      "accept_len": float(1.0 + np.sum(np.cumprod(acc))),
      "targets": [int(x) for x in count],
  }
