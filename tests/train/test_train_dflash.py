"""DFlash / Domino training: the loss by hand, train/inference parity, the block
mask, and the tiny presets end to end (learning, resume, export -> generate)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import dart_jax as dj
from dart_jax.draft.dflash import DFlashDrafter, draft_block
from dart_jax.models.transformer import KVCache
from train import configs, objectives, overrides
from train import dflash_losses as dl
from train import losses
from tests.train.train_helpers import (OVERRIDES, STEPS, crash_then_resume,
                                 metric_records as _records, packed_batch, run_preset)

B = 4  # block size of the tests' drafters (3 draft depths)


@pytest.fixture(scope="module")
def target():
  # Float32: training and inference paths are compared to float32 accuracy (the
  # fast mode's drafters round activations to bf16, which amplifies 1e-7 gaps).
  return dj.load_target(configs.TINY_TARGET, dtype="float32")


def _packed_batch():
  return packed_batch(300)


# ------------------------------------------------------------ loss by hand


def test_position_weights_and_domino_lambda_schedule():
  np.testing.assert_allclose(dl.position_weights(3, 2.0), [1.0, math.exp(-0.5), math.exp(-1.0)],
                             rtol=1e-6)
  np.testing.assert_array_equal(dl.position_weights(4, math.inf), np.ones(4))
  assert dl.default_gamma(16) == 7 and dl.default_gamma(8) == 4 and dl.default_gamma(4) == 1.5
  lam = [float(dl.domino_lambda(s, 40)) for s in (0, 10, 30, 40, 100)]
  np.testing.assert_allclose(lam, [1.0, 0.75, 0.25, 0.0, 0.0], atol=1e-7)
  assert float(dl.domino_lambda(0, 0)) == 0.0  # no anneal: corrected CE only
  # A floor keeps the base loss on after the anneal (and without one).
  floored = [float(dl.domino_lambda(s, 40, 0.3)) for s in (0, 10, 30, 40, 100)]
  np.testing.assert_allclose(floored, [1.0, 0.75, 0.3, 0.3, 0.3], atol=1e-7)
  assert float(dl.domino_lambda(5, 0, 0.25)) == 0.25


def test_block_loss_on_a_hand_computable_case():
  """V=2, one block, D=2. Base: slot 1 logits (0, 0) with label 0 -> CE log 2;
  slot 2 (log 3, 0) with label 1 -> p = 1/4, CE log 4. Corrected: slot 1
  (log 3, 0) -> CE log(4/3); slot 2 (0, 0) -> CE log 2. gamma = 1: w = (1, 1/e)."""
  base = jnp.asarray([[[[0.0, 0.0], [math.log(3), 0.0]]]])
  corrected = jnp.asarray([[[[math.log(3), 0.0], [0.0, 0.0]]]])
  labels = jnp.asarray([[[0, 1]]])
  valid = jnp.asarray([[[True, True]]])
  w = jnp.asarray(dl.position_weights(2, 1.0))
  e = math.exp(-1.0)
  want_base = (math.log(2) + e * math.log(4)) / (1 + e)
  loss, stats = dl.block_loss(base, None, labels, valid, w)
  np.testing.assert_allclose(float(loss), want_base, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stats.ce_sum), [math.log(2), math.log(4)], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(stats.correct), [1, 0])  # argmax(0, 0) = 0
  np.testing.assert_array_equal(np.asarray(stats.count), [1, 1])
  # An invalid slot 2 (e.g. past its segment) drops out of the normalisation too.
  loss, _ = dl.block_loss(base, None, labels, jnp.asarray([[[True, False]]]), w)
  np.testing.assert_allclose(float(loss), math.log(2), rtol=1e-6)
  # Domino: (1 - l) * CE_w(corrected) + l * CE_w(base).
  want_corr = (math.log(4 / 3) + e * math.log(2)) / (1 + e)
  loss, stats = dl.block_loss(base, corrected, labels, valid, w, 0.25)
  np.testing.assert_allclose(float(loss), 0.75 * want_corr + 0.25 * want_base, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stats.ce_sum), [math.log(4 / 3), math.log(2)],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stats.base_ce_sum), [math.log(2), math.log(4)],
                             rtol=1e-6)
  summary = dl.summarize(stats, np.asarray(w), domino=True)
  np.testing.assert_allclose(summary["loss"], want_corr, rtol=1e-6)
  np.testing.assert_allclose(summary["loss_base"], want_base, rtol=1e-6)
  assert summary["acc"] == [1.0, 0.0] and summary["accept_len"] == 2.0
  # With V=2 every label is in the base top-32 candidate table.
  assert summary["recall_base"] == [1.0, 1.0] and summary["accept_len_candidates"] == 3.0


def test_base_recall_counts_labels_in_the_candidate_table():
  """Slot 1's label ranks 1st, slot 2's ranks CANDIDATE_TOPK + 1st (outside)."""
  k = dl.CANDIDATE_TOPK
  vocab = k + 8
  slot1 = jnp.zeros(vocab).at[3].set(5.0)
  slot2 = -jnp.arange(vocab, dtype=jnp.float32)  # token i ranks i-th
  base = jnp.stack([slot1, slot2])[None, None]  # [1, 1, 2, V]
  labels = jnp.asarray([[[3, k]]])
  _, stats = dl.block_loss(base, base, labels, jnp.asarray([[[True, True]]]),
                           jnp.ones(2), 0.5)
  np.testing.assert_array_equal(np.asarray(stats.base_in_topk), [1, 0])
  _, stats = dl.block_loss(base, base, jnp.asarray([[[3, k - 1]]]),
                           jnp.asarray([[[True, True]]]), jnp.ones(2), 0.5)
  np.testing.assert_array_equal(np.asarray(stats.base_in_topk), [1, 1])
  summary = dl.summarize(stats, np.ones(2), domino=True)
  assert summary["accept_len_candidates"] == 3.0


def test_block_targets_inputs_and_labels():
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 0]])
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 0]])
  loss_mask = jnp.asarray([[False, True, True, False, True, True, False]])
  valid = np.asarray(dl.block_targets(loss_mask, seg, 2))[0]
  # valid[a, k-1]: x_{a+k} is a target in a's segment.
  np.testing.assert_array_equal(valid, [[1, 1], [1, 0], [0, 0], [1, 1], [1, 0], [0, 0],
                                        [0, 0]])
  anchors = jnp.asarray([[1, 5]])
  np.testing.assert_array_equal(np.asarray(dl.block_inputs(tokens, anchors, 3, 99)),
                                [[6, 99, 99, 10, 99, 99]])
  np.testing.assert_array_equal(np.asarray(dl.block_labels(tokens, anchors, 2)),
                                [[[7, 8], [0, 0]]])  # clipped at the row end


# ------------------------------------------------- parity with inference


def test_training_forward_matches_inference_per_anchor(target):
  """Each block's base logits equal ``draft_block`` on a cache holding the taps
  of its own segment before the anchor (packed rows, row-index RoPE), and the
  teacher-forced Domino logits equal the inference correction head along the
  ground-truth path."""
  drafter = DFlashDrafter.init(target, block_size=B, num_layers=1, domino=True,
                               target_layer_ids=(1, 3), emb_dim=16, gru_hidden_dim=12, seed=3)
  tm, m = target.module(), drafter.module()
  embed = tm.embed_tokens.embedding[...]
  batch = _packed_batch()
  anchors = jnp.asarray([[3, 10, 14, 17]], jnp.int32)  # 14: first row of segment 2

  @jax.jit
  def train_side(batch, anchors):
    taps = dl.target_taps(tm, batch, drafter.config.taps)
    base, hidden = dl.draft_base(m, tm, taps, batch["tokens"], batch["segment_ids"], anchors)
    labels = dl.block_labels(batch["tokens"], anchors, B - 1)
    roots = jnp.take_along_axis(batch["tokens"], anchors, axis=1)
    return base, dl.teacher_forced_logits(m, embed, base, hidden, roots, labels), labels

  @jax.jit
  def inference_side(segment, n, root, path):
    """segment: [1, 14] tokens of one segment alone (positions 0..13, right-padded);
    the drafter cache holds its first n taps. path: [D-1] tokens after the root."""
    out = tm(segment, jnp.arange(14)[None], None,
             losses.target_attention_mask(jnp.ones((1, 14), jnp.int32)),
             taps=drafter.config.taps)
    cache = m.write_context(out.taps, KVCache.create(1, 1, 32, 2, 16))
    cache = cache.replace(lengths=jnp.full((1,), n, jnp.int32))  # rows >= n: scratch
    logits, hidden, _ = draft_block(tm, m, root[None], cache, attend_len=None,
                                    attn_impl="xla")
    head = m.correction_head(embed, hidden[0])
    state = head.root_state(root)
    corrected, biases = [], []
    for depth in range(1, B):
      biases.append(head.full_bias(depth - 1, state))
      corrected.append(logits[0, depth - 1] + biases[-1])
      if depth < B - 1:
        state = head.gru(path[depth - 1][None], state[None])[0]
    return logits[0], jnp.stack(corrected), jnp.abs(jnp.stack(biases)).max()

  base, corrected, labels = train_side(batch, anchors)
  tokens = np.asarray(batch["tokens"])
  segments = {0: tokens[:, :14], 14: np.pad(tokens[:, 14:22], ((0, 0), (0, 6)))}
  for j, a in enumerate(np.asarray(anchors[0])):
    start = 0 if a < 14 else 14
    want, want_corrected, biggest_bias = inference_side(
        jnp.asarray(segments[start]), a - start, jnp.int32(tokens[0, a]), labels[0, j, :-1])
    np.testing.assert_allclose(np.asarray(base[0, j]), np.asarray(want), atol=2e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(corrected[0, j]), np.asarray(want_corrected),
                               atol=5e-5, rtol=1e-5)
    assert float(biggest_bias) > 1e-2  # the correction is not trivially zero


def test_block_mask_leaks_nothing(target):
  """Gradients of one block's output: zero w.r.t. the other blocks' inputs, the
  context at or after its anchor, and the other segment's context; nonzero
  w.r.t. its own tokens and the context before its anchor."""
  drafter = DFlashDrafter.init(target, block_size=B, num_layers=2, target_layer_ids=(1, 3),
                               seed=4)
  tm, m = target.module(), drafter.module()
  batch = _packed_batch()
  anchors = jnp.asarray([[6, 9, 17]], jnp.int32)
  num_blocks = anchors.shape[1]
  taps = dl.target_taps(tm, batch, drafter.config.taps)
  embeds = tm.embed(dl.block_inputs(batch["tokens"], anchors, B, drafter.config.mask_token_id))
  positions = (anchors[:, :, None] + jnp.arange(B)).reshape(1, -1)
  mask = dl.training_mask(batch["segment_ids"], anchors, B)
  probe = jax.random.normal(jax.random.PRNGKey(0), (1, num_blocks * B, 64))

  @jax.jit
  def grads(embeds, taps, selected):
    """d(block output . probe)/d(inputs) for the block ``selected`` [nb*B] marks."""
    def output(embeds, taps):
      hidden = m.forward_masked(taps, embeds, positions, mask)
      return jnp.sum(hidden * probe * selected[None, :, None])
    return jax.grad(output, argnums=(0, 1))(embeds, taps)

  for j, anchor in enumerate(np.asarray(anchors[0])):
    selected = jnp.asarray(np.arange(num_blocks * B) // B == j, jnp.float32)
    g_embeds, g_taps = grads(embeds, taps, selected)
    per_token = np.abs(np.asarray(g_embeds[0])).sum(-1).reshape(-1, B)  # [blocks, B]
    per_row = np.abs(np.asarray(g_taps[0])).sum(-1)  # [T]
    others = [i for i in range(num_blocks) if i != j]
    assert per_token[others].max() == 0.0, j
    assert per_token[j].min() > 0, j  # every slot of its own block (bidirectional)
    start = 0 if anchor < 14 else 14
    assert per_row[anchor:].max() == 0.0, j  # no context at or after the anchor
    assert per_row[:start].sum() == 0.0, j  # nor from the other segment
    assert per_row[start:anchor].min() > 0, j


# --------------------------------------------------------- configs, init


def test_domino_head_on_a_released_dflash_backbone(target, tmp_path):
  """dflash.init_from = a plain DFlash dir with head.kind=domino keeps the
  backbone and adds a fresh head; a Domino dir with head.kind=dflash is refused."""
  plain = DFlashDrafter.init(target, block_size=B, num_layers=1, target_layer_ids=(1, 3),
                             seed=7)
  dj.save_dflash(plain, tmp_path / "plain")
  config = overrides.load_config("tiny_domino", [f"dflash.init_from={tmp_path / 'plain'}"])
  drafter = objectives.dflash.make(config, target)
  assert drafter.domino and drafter.config.gru_hidden_dim == config.dflash.gru_hidden_dim
  got, want = drafter.module(), plain.module()
  np.testing.assert_array_equal(np.asarray(got.layers[0].mlp.up_proj.kernel[...]),
                                np.asarray(want.layers[0].mlp.up_proj.kernel[...]))
  np.testing.assert_array_equal(np.asarray(got.fc.kernel[...]), np.asarray(want.fc.kernel[...]))
  dj.save_dflash(drafter, tmp_path / "domino")
  with pytest.raises(dj.ConfigError, match="head.kind=domino"):
    objectives.dflash.make(overrides.load_config(
        "tiny_dflash", [f"dflash.init_from={tmp_path / 'domino'}"]), target)


# ------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def domino_run(tmp_path_factory):
  """An uninterrupted tiny Domino run through the command-line entry point."""
  return run_preset("tiny_domino", str(tmp_path_factory.mktemp("domino")))


def test_tiny_domino_run_learns_and_generates_losslessly(domino_run, target):
  train = [r for r in _records(domino_run) if r["split"] == "train"]
  assert [r["step"] for r in train] == list(range(10, STEPS + 1, 10))
  first, last = train[0], train[-1]
  # Measured: about 7.7 -> 3.2 in 60 steps (lambda reaches 0 at step 30); slot
  # accuracies about 0.18 (chance 1/320), the base logits' about 0.05-0.1.
  assert last["loss"] < 0.6 * first["loss"]
  assert first["domino_lambda"] > 0.6 and last["domino_lambda"] == 0.0
  assert min(last["acc"]) > 0.1 and last["accept_len"] > 1.1
  assert sum(last["acc"]) > sum(last["acc_base"])  # the correction head helps
  ev = [r for r in _records(domino_run) if r["split"] == "eval"]
  assert len(ev) == 1 and ev[0]["acc"][0] > 0.1
  drafter = dj.load_domino(os.path.join(domino_run, "export"), target)
  assert drafter.config.block_size == B and drafter.config.target_layer_ids == (1, 3)
  saved = json.load(open(os.path.join(domino_run, "export", "config.json")))
  assert saved["dflash_config"]["projector_type"] == "domino"
  prompt = "What is the capital of France?"
  plain = dj.generate(target, prompt, max_new_tokens=16)
  accept = {}
  for tree in ("dartree", "chain"):
    spec = dj.generate(target, prompt, draft=drafter, tree=tree, max_new_tokens=16)
    assert spec.tokens == plain.tokens, tree  # greedy speculative decoding is lossless
    accept[tree] = spec.stats.mean_accept_len
  # Measured on 48 tokens: dartree about 2.1, the Domino chain about 1.4 (AR: 1.0).
  assert accept["dartree"] > 1.3, accept


def test_domino_crash_and_resume_equals_the_uninterrupted_run(domino_run, tmp_path):
  config = overrides.load_config("tiny_domino", OVERRIDES)
  workdir = str(tmp_path / "resumed")
  _, result = crash_then_resume(config, workdir)
  assert result.start_step == 20
  ours = load_file(os.path.join(workdir, "export", "model.safetensors"))
  reference = load_file(os.path.join(domino_run, "export", "model.safetensors"))
  assert set(ours) == set(reference) and "prefix_gru.weight_ih_l0" in ours
  for name in reference:
    np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6, err_msg=name)
  resumed = [r for r in _records(workdir) if r["split"] == "train"]
  full = [r for r in _records(domino_run) if r["split"] == "train"]
  assert resumed[-1]["step"] == STEPS
  np.testing.assert_allclose(resumed[-1]["loss"], full[-1]["loss"], rtol=1e-5)
