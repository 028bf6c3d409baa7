"""The DART-GRU objective: a GRU correction trained on top of a FROZEN DART head.

Same rows, anchors and frozen target pass as the DART objective
(``train/losses.py``): anchor a's level k predicts x_{a+2+k}, its root is
x_{a+1} (the token after the last real row), and the teacher of level k is the
target's distribution at row a+1+k. The DART head's per-level final hidden
``hid [B, A, D+1, H]`` and logits ``base [B, A, D+1, Vd]`` are computed with
gradients stopped: only the correction trains.

The GRU runs teacher-forced along the ground-truth path: level k uses the
state after ``x_{a+1} .. x_{a+1+k}`` (``s_0`` from the root alone), which is
what inference computes for a tree node whose path equals the data
(``dflash_losses.teacher_forced_logits``; tested against the tree builder's
``CorrectionHead`` arithmetic). Corrected logits:
``base_k + W2 . SiLU(W_z hid_k + W_s s_k)`` over the draft vocabulary.

Loss: the DART objective on the corrected logits, i.e. per level the
cross-entropy against the target's distribution restricted to the draft
vocabulary (computed as the KL, which differs by the teacher's entropy, a
constant), levels weighted ``level_decay ** k``. Soft labels instead of the
data's tokens: the draft vocabulary may not hold a data token, and the frozen
head was trained on the same soft targets. No lambda mix: the base is frozen.
Metrics are DART's (``losses.summarize``) for the corrected logits plus the
same for the frozen head's (``*_base``), so a log line shows what the
correction adds.
"""

from typing import Any

import jax
import jax.numpy as jnp

from train import dflash_losses
from train import losses


def path_tokens(tokens: jax.Array, anchors: jax.Array, num_levels: int
                ) -> tuple[jax.Array, jax.Array]:
  """(roots [B, A] = x_{a+1}, labels [B, A, K] = x_{a+2+k}), clipped at the row end."""
  batch, length = tokens.shape
  rows = jnp.minimum(anchors[:, :, None] + 1 + jnp.arange(num_levels + 1), length - 1)
  path = jnp.take_along_axis(tokens, rows.reshape(batch, -1), axis=1).astype(jnp.int32)
  path = path.reshape(anchors.shape + (num_levels + 1,))
  return path[..., 0], path[..., 1:]


def corrected_levels(dart, correction, target_model, batch: dict, anchors: jax.Array, *,
                     attn_impl: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
  """Teacher-forced corrected logits of every anchor's levels.

  anchors: [B, A]. Returns (corrected [B, A, K, Vd], base [B, A, K, Vd] (the
  frozen head's), teacher: ``losses.Teacher`` at [B, A, K]), K = D+1; only
  ``corrected`` carries gradients (to the correction's parameters).
  """
  c = dart.config
  taps, teacher, next_embeds = losses.target_features(
      target_model, batch, anchors, c.tap_layers, c.num_levels,
      jax.lax.stop_gradient(dart.d2t[...]), attn_impl=attn_impl)
  hidden = jax.lax.stop_gradient(losses.draft_hidden(
      dart, next_embeds, taps, batch["positions"], batch["segment_ids"], anchors,
      attn_impl=attn_impl))
  base = jax.lax.stop_gradient(dart.logits(hidden))
  roots, labels = path_tokens(batch["tokens"], anchors, c.num_levels)
  embed_table = jax.lax.stop_gradient(target_model.embed_tokens.embedding[...])
  corrected = dflash_losses.teacher_forced_logits(correction, embed_table, base, hidden,
                                                  roots, labels)
  return corrected, base, teacher


def forward(dart, correction, target_model, batch: dict, key: jax.Array, *,
            num_anchors: int, level_decay: float, attn_impl: str = "xla"
            ) -> tuple[jax.Array, tuple[losses.LevelStats, losses.LevelStats]]:
  """Loss and (corrected, base) per-level stats of one batch.

  dart: the frozen ``DartHeadModule``; correction: the ``CorrectionModule``
  (differentiable); batch: dict of [B, T] arrays (tokens, loss_mask,
  segment_ids, positions).
  """
  c = dart.config
  valid = losses.level_targets(batch["loss_mask"], batch["segment_ids"], c.num_levels)
  anchors, weights = losses.choose_anchors(key, valid, num_anchors)
  corrected, base, teacher = corrected_levels(dart, correction, target_model, batch,
                                              anchors, attn_impl=attn_impl)
  d2t = jax.lax.stop_gradient(dart.d2t[...])
  loss, stats = losses.dart_loss(corrected, teacher, weights, d2t, level_decay)
  _, base_stats = losses.dart_loss(base, teacher, weights, d2t, level_decay)
  return loss, (stats, base_stats)


def summarize(stats: tuple[losses.LevelStats, losses.LevelStats], level_decay: float
              ) -> dict[str, Any]:
  """DART's metrics of the corrected logits, plus ``loss_base``, ``kl_base``,
  ``acc_base`` and ``accept_len_base`` of the frozen head's."""
  out = losses.summarize(stats[0], level_decay)
  base = losses.summarize(stats[1], level_decay)
  out.update(loss_base=base["loss"], kl_base=base["kl"], acc_base=base["acc"],
             accept_len_base=base["accept_len"])
  return out
