"""DART training objective: train/inference parity, the anchor mask, the loss."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models.transformer import KVCache
from train import losses
from tests.helpers import TINY_TARGET, numpy_head
from tests.train.train_helpers import packed_batch

D = 3
VOCAB = 320


@pytest.fixture(scope="module")
def models():
  target = dj.load_target(TINY_TARGET)
  return target, numpy_head(target, D, 40, seed=1)


def _packed_batch():
  return packed_batch(VOCAB)


def test_training_forward_matches_inference_per_anchor(models):
  """Each anchor's D+1 drafts equal the head's inference call on its own prefix
  (empty cache, prefix = the anchor's segment up to the anchor), and the packed
  target pass gives the teacher rows of the segment run alone."""
  target, head = models
  tm, hm = target.module(), head.module()
  batch = _packed_batch()
  anchors = jnp.asarray([[0, 5, 12, 14, 17]], jnp.int32)  # 14: first row of segment 2

  @jax.jit
  def train_side(batch, anchors):
    taps, teacher, next_embeds = losses.target_forward(tm, batch, anchors,
                                                       hm.config.tap_layers, D + 1)
    return losses.draft_logits(hm, next_embeds, taps, batch["positions"],
                               batch["segment_ids"], anchors), teacher

  @jax.jit
  def segment_alone(tokens):
    n = tokens.shape[1]
    return tm(tokens, jnp.arange(n)[None], None,
              losses.target_attention_mask(jnp.ones((1, n), jnp.int32)),
              taps=hm.config.tap_layers)

  @jax.jit
  def inference(taps, embeds, num_real):
    cache = KVCache.create(1, 1, 32, target.config.num_kv_heads, target.config.head_dim)
    return hm(taps, embeds, num_real, cache, attn_impl="xla")[0]

  draft, teacher = train_side(batch, anchors)
  assert draft.shape == (1, 5, D + 1, 40)
  segments = {0: (0, 14), 14: (14, 22)}
  alone = {s: segment_alone(batch["tokens"][:, s:e]) for s, (_, e) in segments.items()}
  for i, a in enumerate([0, 5, 12, 14, 17]):
    start = 0 if a < 14 else 14
    seg_tokens = batch["tokens"][:, start:segments[start][1]]
    n = seg_tokens.shape[1]
    num_real = a - start + 1
    # Right-padded to a fixed 16 rows (one compile); num_real marks the real ones.
    taps = jnp.zeros((1, 16, alone[start].taps.shape[-1])).at[:, :num_real].set(
        alone[start].taps[:, :num_real])
    nxt = jnp.zeros((1, 16), jnp.int32).at[:, :num_real].set(seg_tokens[:, 1:num_real + 1])
    ref = inference(taps, tm.embed(nxt), jnp.asarray([num_real]))
    np.testing.assert_allclose(draft[0, i], ref[0], atol=2e-5, rtol=1e-5,
                               err_msg=f"anchor {a}")
    for k in range(D + 1):
      row = min(a + 1 + k, 23) - start
      if row < n:
        np.testing.assert_allclose(teacher[0, i, k], alone[start].logits[0, row],
                                   atol=2e-5, rtol=1e-5, err_msg=f"teacher {a} level {k}")


def test_head_attention_mask_by_hand():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
  anchors = jnp.asarray([[1, 3]], jnp.int32)
  mask = np.asarray(losses.head_attention_mask(seg, anchors, 2))[0]
  assert mask.shape == (6 + 4, 6 + 4)
  expected = np.zeros((10, 10), bool)
  for i in range(6):  # real rows: causal within the segment
    for j in range(i + 1):
      expected[i, j] = [1, 1, 1, 2, 2, 0][i] == [1, 1, 1, 2, 2, 0][j]
  # anchor 1 (segment 1): rows 6, 7 see real 0, 1 and mask rows 6..k
  expected[6, [0, 1, 6]] = True
  expected[7, [0, 1, 6, 7]] = True
  # anchor 3 (segment 2 starts at 3): rows 8, 9 see real 3 only
  expected[8, [3, 8]] = True
  expected[9, [3, 8, 9]] = True
  np.testing.assert_array_equal(mask, expected)


def test_no_mask_row_sees_the_future_or_other_anchors_gradient(models):
  """Gradient leak test through the real attention layer: the output of every
  row depends on exactly the input rows the prefix-isolated mask allows."""
  target, head = models
  tm, hm = target.module(), head.module()
  batch = _packed_batch()
  anchors = jnp.asarray([[2, 9, 15]], jnp.int32)
  from dart_jax.models import layers

  taps, _, next_embeds = losses.target_forward(tm, batch, anchors, hm.config.tap_layers, D + 1)
  attn_in, residual, pos = losses.head_rows(hm, next_embeds, taps, batch["positions"], anchors)
  mask = losses.head_attention_mask(batch["segment_ids"], anchors, D)
  cos, sin = layers.rope_cos_sin(pos, hm.inv_freq)
  n = attn_in.shape[1]

  @jax.jit
  def rows_out(x):
    attn, _, _ = hm.midlayer.self_attn(x, cos, sin, None, None, None, mask, None, "xla")
    return hm.finish(residual + attn)[0].sum(-1)  # [N]

  jac = np.asarray(jax.jacrev(rows_out)(attn_in))  # [N, 1, N, 2H]
  depends_all = np.abs(jac[:, 0]).sum(-1) > 0  # [N out, N in]
  seg = np.asarray(batch["segment_ids"][0])
  t = seg.shape[0]
  for r in range(n):
    allowed = np.zeros(n, bool)
    if r < t:
      allowed[:r + 1] = seg[:r + 1] == seg[r]
    else:
      i, k = divmod(r - t, D)
      a = int(anchors[0, i])
      allowed[:a + 1] = seg[:a + 1] == seg[a]
      allowed[t + i * D:t + i * D + k + 1] = True
    np.testing.assert_array_equal(depends_all[r], allowed, err_msg=f"row {r}")


def test_drafts_ignore_tokens_after_the_anchor_and_other_segments(models):
  """End to end (target + head): changing x_{a+2}.. or another segment leaves
  anchor a's drafts bit-identical; changing x_{a+1} changes them."""
  target, head = models
  tm, hm = target.module(), head.module()
  batch = _packed_batch()
  anchors = jnp.asarray([[4, 16]], jnp.int32)

  @jax.jit
  def drafts_jit(tokens):
    b = dict(batch, tokens=tokens)
    taps, _, ne = losses.target_forward(tm, b, anchors, hm.config.tap_layers, D + 1)
    return losses.draft_logits(hm, ne, taps, b["positions"], b["segment_ids"], anchors)

  drafts = lambda tokens: np.asarray(drafts_jit(tokens))

  base = drafts(batch["tokens"])
  future = batch["tokens"].at[0, 6:14].set(1)  # after anchor 4 (+1), same segment
  other_seg = batch["tokens"].at[0, 14:22].set(2)  # all of segment 2
  changed = drafts(future)
  np.testing.assert_array_equal(changed[0, 0], base[0, 0])
  np.testing.assert_array_equal(drafts(other_seg)[0, 0], base[0, 0])
  assert np.abs(drafts(batch["tokens"].at[0, 5].set(7))[0, 0] - base[0, 0]).max() > 1e-4
  assert np.abs(changed[0, 1] - base[0, 1]).max() == 0  # segment 2 untouched
  assert np.abs(drafts(other_seg)[0, 1] - base[0, 1]).max() > 1e-4


def test_level_targets_and_anchor_choice():
  loss_mask = jnp.asarray([[0, 0, 0, 1, 1, 1, 0, 0]], bool)
  seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2]], jnp.int32)
  valid = np.asarray(losses.level_targets(loss_mask, seg, 2))[0]
  # level k of anchor a targets x_{a+2+k}
  np.testing.assert_array_equal(valid[:, 0], [0, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(valid[:, 1], [1, 1, 1, 0, 0, 0, 0, 0])
  anchors, weights = losses.choose_anchors(jax.random.PRNGKey(0), jnp.asarray(valid[None]), 3)
  a = np.asarray(anchors[0])
  assert sorted(set(a.tolist())) == a.tolist() and set(a.tolist()) <= {0, 1, 2, 3}
  np.testing.assert_array_equal(np.asarray(weights[0]), valid[a])
  all_anchors, _ = losses.choose_anchors(jax.random.PRNGKey(0), jnp.asarray(valid[None]), 0)
  np.testing.assert_array_equal(np.asarray(all_anchors[0]), np.arange(8))


def test_dart_loss_matches_numpy():
  rng = np.random.default_rng(3)
  b, a, k, v, vd = 2, 3, 3, 12, 5
  draft = rng.standard_normal((b, a, k, vd)).astype(np.float32)
  teacher = rng.standard_normal((b, a, k, v)).astype(np.float32) * 2
  weights = rng.random((b, a, k)) < 0.7
  used = np.array([0, 2, 3, 7, 11])
  d2t = used - np.arange(vd)
  # Make one teacher argmax land on a draft id and get predicted there.
  teacher[0, 0, 0, 7] = 10.0
  draft[0, 0, 0, 3] = 10.0
  weights[0, 0, 0] = True
  loss, stats = losses.dart_loss(
      jnp.asarray(draft), losses.teacher_from_logits(jnp.asarray(teacher), jnp.asarray(d2t)),
      jnp.asarray(weights), jnp.asarray(d2t), 0.6)

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  log_p = log_softmax(teacher[..., used].astype(np.float64))
  log_q = log_softmax(draft.astype(np.float64))
  kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
  expected = sum(0.6 ** j * (kl[:, :, j] * weights[:, :, j]).sum() / weights[:, :, j].sum()
                 for j in range(k))
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  correct = used[draft.argmax(-1)] == teacher.argmax(-1)
  np.testing.assert_allclose(np.asarray(stats.correct), (correct * weights).sum((0, 1)))
  np.testing.assert_allclose(np.asarray(stats.count), weights.sum((0, 1)))
  assert correct[0, 0, 0]


def test_summarize_acceptance_length():
  stats = losses.LevelStats(kl_sum=np.array([2.0, 4.0, 0.0]), correct=np.array([5.0, 2.0, 0.0]),
                            count=np.array([10.0, 4.0, 0.0]))
  s = losses.summarize(stats, 0.5)
  assert s["acc"] == [0.5, 0.5, 0.0]
  assert s["accept_len"] == pytest.approx(1 + 0.5 + 0.25)
  assert s["loss"] == pytest.approx(0.2 + 0.5 * 1.0)
