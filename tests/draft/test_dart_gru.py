"""DART-GRU: lossless decoding, training/inference parity of the corrected logits,
the draft-vocabulary tree builder, save/load, and a short training run."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dart_jax as dj
from dart_jax.decode.methods import make_decoder
from dart_jax.draft.dart_gru import CORRECTION_CONFIG
from dart_jax.models import Target
from dart_jax.sampling import SamplingConfig
from dart_jax.decode.round import root_tokens
from dart_jax.draft.correction import CorrectionHead
from dart_jax.tree.dartree import DARTreeConfig, dartree_build
from tests.helpers import (PRECISIONS, TARGETS, check_first_tokens_distribution,
                           peaked_tiny_target)
from tests.train.train_helpers import metric_records
from train import configs, loop
from train import dart_gru_losses
from train import main as train_main

TREE = DARTreeConfig(topk=4, supertree_width=3, budget=8)
D = 3  # mask slots: D+1 = 4 levels


@pytest.fixture(scope="module", params=PRECISIONS)
def tiny(request):
  target = Target.init(TARGETS["llama"], seed=2, dtype=request.param)
  head = dj.DartHead.init(target, draft_length=D, draft_vocab_size=60, seed=4)
  # A sparse draft vocabulary (not the first 60 ids), so d2t matters.
  head = head.with_draft_vocab(np.random.default_rng(1).choice(97, 60, replace=False))
  drafter = dj.DartGruDrafter.from_head(head, emb_dim=16, gru_hidden_dim=24, seed=5)
  return target, drafter


def test_greedy_equals_ar_token_for_token(tiny):
  """Batch of 4 ragged prompts, float32, the pruned / fixed trees and the chain."""
  target, drafter = tiny
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 97, rng.integers(1, 12)).tolist() for _ in range(4)]
  ar = dj.generate(target, prompts, max_new_tokens=16, eos_token_ids=()).tokens
  for tree in ("dartree", "dartree-fixed", "chain"):
    out = dj.generate(target, prompts, max_new_tokens=16, draft=drafter, tree=tree,
                      tree_config=TREE, eos_token_ids=())
    assert out.tokens == ar, tree
    assert out.stats.mean_accept_len >= 1.0


def test_decoder_rejects_an_ngram_and_unknown_tree_options(tiny):
  target, drafter = tiny
  with pytest.raises(dj.InputError, match="N-gram"):
    dj.generate(target, [1, 2], max_new_tokens=2, draft=drafter, ngram=object())
  with pytest.raises(dj.InputError, match="unknown DARTree option"):
    dj.generate(target, [1, 2], max_new_tokens=2, draft=drafter, beam_width=3)
  with pytest.raises(dj.ConfigError, match="unknown DARTree method"):
    dj.generate(target, [1, 2], max_new_tokens=2, draft=drafter, tree="beam")


@pytest.mark.parametrize("method", ["dartree", "dartree-fixed", "domino-chain",
                                    "dflash-chain"])
def test_draft_vocabulary_tree_equals_the_scattered_target_vocabulary_tree(method):
  """dartree_build over Vd columns with d2t == over V columns with the logits and
  W2 scattered through d2t (-inf / 0 elsewhere): same tokens, parents, scores."""
  rng = np.random.default_rng(3)
  depths, vd, vocab, e, g, h = 4, 12, 40, 6, 5, 8
  used = np.sort(rng.choice(vocab, vd, replace=False))
  d2t = jnp.asarray(used - np.arange(vd), jnp.int32)
  base = rng.normal(size=(depths, vd)).astype(np.float32)
  w_out = rng.normal(size=(e, vd)).astype(np.float32)
  head = CorrectionHead(
      z=jnp.asarray(rng.normal(size=(depths, e)), jnp.float32),
      w_state=jnp.asarray(rng.normal(size=(g, e)), jnp.float32), w_out=jnp.asarray(w_out),
      w_input=jnp.asarray(rng.normal(size=(h, 3 * g)), jnp.float32),
      w_hidden=jnp.asarray(rng.normal(size=(g, 3 * g)), jnp.float32),
      embed=jnp.asarray(rng.normal(size=(vocab, h)), jnp.float32))
  full_base = np.full((depths, vocab), -np.inf, np.float32)
  full_base[:, used] = base
  full_w_out = np.zeros((e, vocab), np.float32)
  full_w_out[:, used] = w_out
  config = DARTreeConfig(topk=3, supertree_width=4, budget=7)
  root = jnp.int32(int(np.setdiff1d(np.arange(vocab), used)[0]))  # not a draft id

  def build(logits, w, d2t):
    return dartree_build(logits, root, head.replace(w_out=w), config, method=method,
                         d2t=d2t)

  ours, ref = jax.jit(lambda: (build(jnp.asarray(base), jnp.asarray(w_out), d2t),
                               build(jnp.asarray(full_base), jnp.asarray(full_w_out),
                                     None)))()
  assert set(np.asarray(ours.tokens[1:]).tolist()) <= set(used.tolist())
  for name in ("tokens", "parents", "depth", "num_nodes", "mask"):
    np.testing.assert_array_equal(getattr(ours, name), getattr(ref, name), err_msg=name)
  np.testing.assert_allclose(ours.scores, ref.scores, rtol=0, atol=1e-5)


def _prefill(target, drafter, prompts):
  """The decoder's own prefill, with the shapes ``generate`` uses in the test
  above (batch 4, 32 prompt columns, capacity 256): its compiled code is reused."""
  decoder = make_decoder(target, SamplingConfig(), 0, drafter, tree="chain",
                         tree_config=TREE)
  tokens = np.zeros((len(prompts), 32), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  state, first = decoder.start(jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts],
                                                                  jnp.int32), 256)
  return first, state, decoder


def test_teacher_forced_logits_equal_inference_corrected_logits(tiny):
  """Training's teacher-forced corrected logits along a path == the decoder's:
  (a) recomputed with the CorrectionHead the tree builder uses, from the state
  the decoding prefill leaves; (b) the corrected chain the builder drafts (its
  tokens are the argmaxes, its scores the cumulative log-softmax)."""
  target, drafter = tiny
  prompt = [5, 17, 3, 44, 9, 71, 2]
  first, state, decoder = _prefill(target, drafter, [prompt, [1], [2, 3], [4, 5, 6]])
  module = drafter.module()
  target_model = target.module()
  assert decoder.proposer.method == "domino-chain"
  chain = jax.jit(lambda params, s: decoder.proposer.propose(target_model, params, s))(
      decoder.draft_params, state)
  assert int(root_tokens(state)[0]) == int(first[0])
  path = np.asarray(chain.tokens[0, 1:]).tolist()  # D+1 target ids, levels 0..D

  @jax.jit
  def inference_and_training(state, path, tokens):
    # Inference arithmetic along the path (the builder's CorrectionHead methods).
    head = module.correction_head(target_model.embed_tokens.embedding[...],
                                  state.draft.hidden[0])
    s = head.root_state(first[0])
    inference = []
    for k in range(D + 1):
      inference.append(state.draft.logits[0, k] + head.full_bias(k, s))
      s = head.gru(path[k][None], s[None])[0]
    # Training: one packed row [prompt, root, path], anchor = last prompt position.
    n = tokens.shape[1]
    batch = {"tokens": tokens, "segment_ids": jnp.ones((1, n), jnp.int32),
             "positions": jnp.arange(n, dtype=jnp.int32)[None],
             "loss_mask": jnp.ones((1, n), bool)}
    anchors = jnp.asarray([[len(prompt) - 1]], jnp.int32)
    corrected, base, _ = dart_gru_losses.corrected_levels(
        module.dart, module.correction, target_model, batch, anchors)
    return jnp.stack(inference), corrected, base

  tokens = jnp.asarray([prompt + [int(first[0])] + path], jnp.int32)
  inference, corrected, base = inference_and_training(state, jnp.asarray(path), tokens)
  np.testing.assert_allclose(base[0, 0], state.draft.logits[0], rtol=0, atol=1e-5)
  np.testing.assert_allclose(corrected[0, 0], inference, rtol=0, atol=1e-5)
  # The correction changes the logits (a test that could not tell base from
  # corrected would pass trivially).
  assert np.max(np.abs(np.asarray(corrected - base))) > 1e-2
  d2t = np.asarray(module.dart.d2t[...])
  argmax = np.argmax(np.asarray(corrected[0, 0]), axis=-1)
  assert (argmax + d2t[argmax]).tolist() == path
  log_probs = jax.nn.log_softmax(corrected[0, 0], axis=-1)
  np.testing.assert_allclose(np.cumsum(np.max(log_probs, axis=-1)), chain.scores[0, 1:],
                             rtol=0, atol=1e-5)


def _leaves(drafter):
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(drafter.params))}


def test_save_load_round_trip(tiny, tmp_path):
  target, drafter = tiny
  dj.save_dart_gru(drafter, tmp_path / "gru")
  assert sorted(os.listdir(tmp_path / "gru")) == [
      "config.json", "correction.json", "correction.safetensors", "model.safetensors"]
  loaded = dj.load_dart_gru(tmp_path / "gru", target)
  assert loaded.config == drafter.config
  want, got = _leaves(drafter), _leaves(loaded)
  assert sorted(want) == sorted(got)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  # The directory is also a plain DART head directory.
  head = dj.load_dart(tmp_path / "gru", target)
  np.testing.assert_array_equal(head.params["d2t"][...], drafter.module().dart.d2t[...])


def test_bad_directories_raise_clear_errors(tiny, tmp_path):
  target, drafter = tiny
  missing = tmp_path / "nope"
  with pytest.raises(dj.CheckpointError, match=str(missing)):
    dj.load_dart_gru(missing, target)
  dj.save_dart(drafter.dart_head(), tmp_path / "head_only")
  with pytest.raises(dj.CheckpointError, match="correction.json.*load_dart"):
    dj.load_dart_gru(tmp_path / "head_only", target)

  def saved_with(name, **changes):
    path = tmp_path / name
    dj.save_dart_gru(drafter, path)
    with open(path / CORRECTION_CONFIG) as f:
      raw = json.load(f)
    raw.update(changes)
    with open(path / CORRECTION_CONFIG, "w") as f:
      json.dump(raw, f)
    return path

  with pytest.raises(dj.CheckpointError, match="embed_proj.0.weight has shape"):
    dj.load_dart_gru(saved_with("wide", emb_dim=17), target)
  with pytest.raises(dj.ConfigError, match="num_levels=9.*has 4"):
    dj.load_dart_gru(saved_with("levels", num_levels=9), target)
  with pytest.raises(dj.ConfigError, match="'format'"):
    dj.load_dart_gru(saved_with("format", format="other"), target)
  os.remove(saved_with("no_weights") / "correction.safetensors")
  with pytest.raises(dj.CheckpointError, match="correction.safetensors not found"):
    dj.load_dart_gru(tmp_path / "no_weights", target)
  other = Target.init(dataclasses.replace(TARGETS["llama"], hidden_size=48), seed=2)
  with pytest.raises(dj.ConfigError, match="does not fit"):
    dj.load_dart_gru(saved_with("other_target"), other)


def test_tiny_training_lowers_the_loss_and_exports_a_loadable_drafter(tmp_path):
  """tiny_dart_gru on a random DART head for the bundled tiny target: the loss
  falls, the DART head stays frozen, the export loads with load_dart_gru."""
  target = dj.load_target(configs.TINY_TARGET)
  head = dj.DartHead.init(target, draft_length=2, draft_vocab_size=256, seed=3)
  dj.save_dart(head, tmp_path / "head")
  workdir = str(tmp_path / "run")
  assert train_main.main([
      "--config", "tiny_dart_gru", "--workdir", workdir, f"head.init_from={tmp_path / 'head'}",
      "steps=24", "log_every=4", "eval_every=24", "checkpoint_every=24",
      "optim.warmup_steps=2", "data.max_len=64", "batch_size=4", "progress=false"]) == 0
  train = [r for r in metric_records(workdir) if r["split"] == "train"]
  assert len(train) == 6
  assert train[-1]["loss"] < 0.8 * train[0]["loss"], [r["loss"] for r in train]
  # The frozen head's own loss is the same kind of number: the correction beats it.
  assert train[-1]["loss"] < train[-1]["loss_base"]
  loaded = dj.load_dart_gru(os.path.join(workdir, "export"), target)
  assert (loaded.config.emb_dim, loaded.config.gru_hidden_dim) == (32, 32)
  frozen, initial = loaded.dart_head().module(), head.module()
  for name in ("lm_head", "fc"):
    np.testing.assert_array_equal(getattr(frozen, name).matrix(),
                                  getattr(initial, name).matrix())
  state = loop.init_state(loaded, loop.StepSettings(
      head_config=loaded.config, num_anchors=4, level_decay=0.6, param_dtype="float32",
      compute_dtype="auto", attn_impl="xla", optim=configs.OptimSection(), steps=1), 0)
  assert set(state["params"]) == {"prefix_gru", "embed_proj_in", "embed_proj_out"}


@pytest.mark.parametrize("mode", PRECISIONS)
def test_sampling_matches_target_distribution(mode):
  """DART-GRU (pruned tree) samples the target's distribution (the statistics of
  the DARTree sampling test)."""
  target = peaked_tiny_target(mode)
  head = dj.DartHead.init(target, draft_length=2, seed=3)
  drafter = dj.DartGruDrafter.from_head(head, emb_dim=8, gru_hidden_dim=8, seed=1)
  check_first_tokens_distribution(
      target, "dart-gru", draft=drafter, tree="dartree",
      tree_config=DARTreeConfig(topk=3, supertree_width=3, budget=6))
