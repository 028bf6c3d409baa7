"""Packing a trained head + N-gram into shipped assets, and the shipped ones."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.decode.methods import make_decoder
from dart_jax.io import default_model
from dart_jax.sampling import SamplingConfig
from train import configs, data as data_lib, embedded_assets


@pytest.fixture(scope="module")
def tiny_target():
  return dj.load_target(configs.TINY_TARGET, dtype=np.float32)


def _assert_within_float16_rounding(params, shipped_params):
  """float16 storage: every weight within half-precision rounding of the original."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  shipped_leaves = jax.tree_util.tree_leaves(shipped_params)
  assert len(leaves) == len(shipped_leaves)
  for (path, a), b in zip(leaves, shipped_leaves):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_pack_round_trip(tiny_target, tmp_path, monkeypatch):
  head = dj.DartHead.init(tiny_target, draft_length=3, draft_vocab_size=64, seed=1)
  head = head.with_draft_vocab(np.arange(0, 128, 2))
  dj.save_dart(head, tmp_path / "export")
  # A tree measured for panel targets with an earlier head does not survive a re-pack.
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "manifest.json").write_text(json.dumps(
      {"tree_panels": {"topk": 2, "beam_width": 2, "remain_total": 2}, "domino": {}}))
  manifest = embedded_assets.pack(tiny_target, list(configs.SAMPLE_DATA),
                                  str(tmp_path / "export"), str(tmp_path / "out"),
                                  order=3, min_count=1, tree_budget="5")
  assert manifest["tree"] == {"topk": 5, "beam_width": 5, "remain_total": 5}
  assert "tree_panels" not in manifest and manifest["domino"] == {}
  shipped = dj.load_dart(tmp_path / "out" / "dart_head", tiny_target)
  monkeypatch.setattr(default_model, "EMBEDDED_ASSETS", tmp_path / "out")
  as_shipped = dj.load_dart(target=tiny_target)  # no panel tree: the head's serves
  assert as_shipped.tree == dj.tree.TreeConfig(**manifest["tree"])
  assert as_shipped.panel_tree is None
  _assert_within_float16_rounding(head.params, shipped.params)
  assert manifest["files"]["dart_head/model.safetensors"] == os.path.getsize(
      tmp_path / "out" / "dart_head" / "model.safetensors")
  # The N-gram counts the chat-rendered training tokens: a 3-gram of the first
  # conversation is found with the exact relative frequency.
  stats = data_lib.DataStats()
  records = data_lib.read_records(list(configs.SAMPLE_DATA), stats)
  tokens = [e.tokens for e in data_lib.tokenize_records(tiny_target.tokenizer, records, stats)]
  ngram = dj.load_ngram(tmp_path / "out" / "ngram.trie")
  context, nxt = tokens[0][:2], tokens[0][2]
  windows = [tuple(t[i:i + 3]) for t in tokens for i in range(len(t) - 2)]
  starts = [tuple(t[i:i + 2]) for t in tokens for i in range(len(t) - 1)]
  expected = windows.count((*context, nxt)) / starts.count(tuple(context))
  probs, matched = ngram.probability(np.asarray(context), np.asarray([nxt]))
  assert matched[0] == 2
  np.testing.assert_allclose(probs[0], expected, rtol=1e-6)


def test_pack_drafter_keeps_the_head_entries_and_sets_the_shipped_tree(
    tiny_target, tmp_path, monkeypatch):
  out = tmp_path / "out"
  out.mkdir()
  head_entries = {"tree": {"topk": 6, "beam_width": 6, "remain_total": 6},
                  "files": {"dart_head/model.safetensors": 123}}
  (out / "manifest.json").write_text(json.dumps(head_entries))
  drafter = dj.DFlashDrafter.init(tiny_target, block_size=4, domino=True, emb_dim=8,
                                  gru_hidden_dim=8, seed=1)
  dj.save_dflash(drafter, tmp_path / "export")
  tree = dj.tree.DARTreeConfig(topk=4, supertree_width=3, budget=8, depth_bonus=-0.5)
  manifest = embedded_assets.pack_drafter(tiny_target, str(tmp_path / "export"), str(out),
                                          tree)
  assert json.loads((out / "manifest.json").read_text()) == manifest
  assert manifest["tree"] == head_entries["tree"]
  assert manifest["dartree"] == {"topk": 4, "supertree_width": 3, "budget": 8,
                                 "depth_bonus": -0.5}
  assert manifest["domino"]["block_size"] == 4 and manifest["domino"]["emb_dim"] == 8
  assert manifest["files"]["dart_head/model.safetensors"] == 123
  assert manifest["files"]["domino/model.safetensors"] == os.path.getsize(
      out / "domino" / "model.safetensors")
  # float16 on disk: about half the bytes of the float32 export.
  assert os.path.getsize(out / "domino" / "model.safetensors") < 0.6 * os.path.getsize(
      tmp_path / "export" / "model.safetensors")
  # As shipped: load_domino() with no path loads it with its measured tree.
  monkeypatch.setattr(default_model, "EMBEDDED_ASSETS", out)
  shipped = dj.load_domino(target=tiny_target)
  assert shipped.tree_config == tree
  _assert_within_float16_rounding(drafter.params, shipped.params)
  # generate's default tree is the measured one; given fields change only themselves.
  decoder = make_decoder(tiny_target, SamplingConfig(), 0, shipped)
  assert decoder.proposer.tree_config == tree
  decoder = make_decoder(tiny_target, SamplingConfig(), 0, shipped, budget=5)
  assert decoder.proposer.tree_config == dataclasses.replace(tree, budget=5)
  decoder = dj.DARTree(shipped, "dartree").decoder(tiny_target, SamplingConfig())
  assert decoder.proposer.tree_config == tree  # the typed method, no config given


def test_missing_assets_are_clear_errors(monkeypatch, tmp_path, tiny_target):
  monkeypatch.setattr(default_model, "EMBEDDED_ASSETS", tmp_path / "nothing")
  with pytest.raises(dj.CheckpointError, match="packaged DART head is missing"):
    dj.load_dart()
  with pytest.raises(dj.CheckpointError, match="packaged N-gram is missing"):
    dj.load_ngram()
  with pytest.raises(dj.CheckpointError, match="packaged Domino drafter is missing"):
    dj.load_domino(target=tiny_target)
  with pytest.raises(dj.ConfigError, match="need the target"):
    dj.load_domino()


def test_shipped_assets_are_small_and_fit_the_embedded_target():
  manifest_path = default_model.EMBEDDED_ASSETS / "manifest.json"
  manifest = json.loads(manifest_path.read_text())
  total = sum(manifest["files"].values())
  assert total < 60e6, f"shipped assets are {total / 1e6:.1f} MB"  # head 20, drafter 23, N-gram 6
  for name, size in manifest["files"].items():
    assert os.path.getsize(default_model.EMBEDDED_ASSETS / name) == size, name
  head = dj.load_dart()  # No target: tap layers come from the shipped config.
  assert head.tree == dj.tree.TreeConfig(**manifest["tree"])  # generate's default tree
  assert head.panel_tree == dj.tree.TreeConfig(**manifest["tree_panels"])  # ... on panels
  assert head.config.vocab_size == 49152 and head.config.target_hidden_size == 576
  assert head.config.draft_vocab_size == manifest["draft_vocab_size"]
  ngram = dj.load_ngram()
  assert ngram.order == manifest["ngram_order"]
