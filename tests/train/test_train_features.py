"""Cached frozen-target features: same training as the online step, resumable build."""

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

import dart_jax as dj
from dart_jax.errors import ConfigError
from train import features, loop, overrides
from train.data import Rows
from tests.train.train_helpers import metric_records
from tests.helpers import TINY_TARGET, numpy_head

STEPS = 12
OVERRIDES = [f"steps={STEPS}", "optim.warmup_steps=2", "checkpoint_every=6", "eval_every=12",
             "log_every=3", "progress=false", "data.max_examples=64"]


@pytest.fixture(scope="module")
def tiny():
  target = dj.load_target(TINY_TARGET)
  head = numpy_head(target, 3, 40, seed=1)
  rng = np.random.default_rng(0)
  num_rows, length = 5, 24
  tokens = rng.integers(3, target.config.vocab_size, (num_rows, length)).astype(np.int32)
  segment_ids = np.ones((num_rows, length), np.int32)
  segment_ids[:, 20:] = 0
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (num_rows, length)).copy()
  rows = Rows(tokens, segment_ids > 0, segment_ids, positions)
  d2t = np.asarray(head.params["d2t"][...])
  return target, head, rows, d2t


def _build(tiny, workdir, **kw):
  target, head, rows, d2t = tiny
  return features.load_or_build(target, rows, head.config.tap_layers, d2t, str(workdir),
                                batch_size=2, progress=False, **kw)


def test_stored_features_are_the_target_pass(tiny, tmp_path):
  """Every row holds the target's taps and teacher, computed here independently
  from full-vocabulary logits with numpy."""
  target, head, rows, d2t = tiny
  store = _build(tiny, tmp_path, dtype="float32")
  assert len(store) == len(rows)
  stored = store.take(np.array([3]))
  from train.losses import target_attention_mask
  row = 3
  out = target.forward(rows.tokens[row:row + 1], rows.positions[row:row + 1], None,
                       target_attention_mask(rows.segment_ids[row:row + 1]),
                       taps=head.config.tap_layers)
  logits = np.asarray(out.logits[0], np.float64)  # [T, V]
  used = np.arange(len(d2t)) + d2t
  kept = logits[:, used]
  logp = kept - kept.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  np.testing.assert_allclose(stored["taps"][0], np.asarray(out.taps[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stored["teacher_logp"][0], logp, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(stored["teacher_argmax"][0], logits.argmax(-1))
  # float16 storage: the same numbers to half precision.
  half = _build(tiny, tmp_path / "half", dtype="float16").take(np.array([row]))
  assert half["taps"].dtype == np.float16
  np.testing.assert_allclose(half["teacher_logp"][0], logp, rtol=2e-3, atol=2e-2)


def test_compact_teacher_keeps_the_top_k_and_the_tail_mass(tiny, tmp_path):
  """teacher_topk=K: the K most likely ids are stored exactly, the other ids share
  the rest of the mass; the file is about Vd / K times smaller."""
  target, head, rows, d2t = tiny
  dense = _build(tiny, tmp_path / "dense", dtype="float32")
  k = 8
  compact = _build(tiny, tmp_path / "compact", dtype="float32", teacher_topk=k)
  [compact_arrays] = compact.parts
  assert "teacher_logp" not in compact_arrays and compact_arrays["teacher_ids"].shape[-1] == k
  index = np.arange(len(rows))
  dense_rows = dense.take(index)
  full = dense_rows["teacher_logp"]
  rebuilt = compact.take(index)
  np.testing.assert_array_equal(rebuilt["taps"], dense_rows["taps"])
  np.testing.assert_array_equal(rebuilt["teacher_argmax"], dense_rows["teacher_argmax"])
  top = np.argsort(-full, axis=-1)[..., :k]
  np.testing.assert_allclose(np.take_along_axis(rebuilt["teacher_logp"], top, -1),
                             np.take_along_axis(full, top, -1), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.exp(rebuilt["teacher_logp"]).sum(-1), 1.0, atol=1e-4)
  rest = np.ones(full.shape, bool)
  np.put_along_axis(rest, top, False, -1)
  tail = np.where(rest, np.exp(full), 0).sum(-1)
  np.testing.assert_allclose(np.where(rest, np.exp(rebuilt["teacher_logp"]), 0).sum(-1),
                             tail, rtol=1e-3, atol=1e-6)
  teacher_bytes = lambda store: sum(a.nbytes for n, a in store.parts[0].items()
                                    if n.startswith("teacher_") and n != "teacher_argmax")
  assert teacher_bytes(dense) >= (len(d2t) / (2 * k)) * teacher_bytes(compact)
  assert compact.directories != dense.directories
  with pytest.raises(ConfigError, match="teacher_topk"):
    _build(tiny, tmp_path / "bad", teacher_topk=len(d2t))


def test_interrupted_build_resumes_where_it_stopped(tiny, tmp_path):
  reference = _build(tiny, tmp_path / "whole", dtype="float32")

  class Stop(Exception):
    pass

  def stop_after_first(rows_done):
    raise Stop

  with pytest.raises(Stop):
    _build(tiny, tmp_path / "cut", dtype="float32", batch_callback=stop_after_first)
  resumed_at = []
  store = _build(tiny, tmp_path / "cut", dtype="float32", batch_callback=resumed_at.append)
  assert resumed_at == [4, 5]  # rows 0-1 were kept; batches of 2 from row 2 on
  index = np.arange(len(tiny[2]))
  for name, values in reference.take(index).items():
    np.testing.assert_array_equal(store.take(index)[name], values)
  # Complete: a third call computes nothing.
  again = []
  _build(tiny, tmp_path / "cut", dtype="float32", batch_callback=again.append)
  assert again == []


def test_damaged_features_are_rebuilt(tiny, tmp_path):
  store = _build(tiny, tmp_path, dtype="float32")
  index = np.arange(len(store))
  expected = store.take(index)["teacher_logp"]
  [directory] = store.directories
  path = os.path.join(directory, "teacher_logp.npy")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  rebuilt = _build(tiny, tmp_path, dtype="float32")
  assert rebuilt.directories == store.directories
  np.testing.assert_array_equal(rebuilt.take(index)["teacher_logp"], expected)


def test_keys_follow_what_the_features_depend_on(tiny):
  target, head, rows, d2t = tiny
  taps = head.config.tap_layers
  key = features.settings_key(target, taps, d2t, "float16")
  assert key == features.settings_key(target, taps, d2t.copy(), "float16")
  other_vocab = d2t.copy()
  other_vocab[-1] += 1
  assert len({key, features.settings_key(target, taps, other_vocab, "float16"),
              features.settings_key(target, taps, d2t, "float32"),
              features.settings_key(target, taps, d2t, "float16", teacher_topk=8),
              features.settings_key(target, taps[::-1], d2t, "float16")}) == 5
  keys = features.row_keys(rows)
  assert len(set(keys.tolist())) == len(rows)
  changed = {name: np.array(value) for name, value in rows.take(np.arange(len(rows))).items()}
  changed["positions"][2, 3] += 1
  changed_keys = features.row_keys(Rows(**changed))
  np.testing.assert_array_equal(changed_keys != keys, np.arange(len(rows)) == 2)


def test_a_run_over_more_rows_computes_only_the_new_ones(tiny, tmp_path):
  """Rows are found by content in any complete part: a second run over a
  superset, in another order, builds only its new rows and reads the same
  features as building everything from scratch."""
  target, head, rows, d2t = tiny
  first = Rows(**rows.take(np.array([3, 0, 1])))
  built = []
  _build((target, head, first, d2t), tmp_path / "shared", dtype="float32",
         batch_callback=built.append)
  assert built == [2, 3]
  more = Rows(**rows.take(np.array([4, 1, 2, 3, 0, 1])))  # 2 new, row 1 twice
  built.clear()
  store = _build((target, head, more, d2t), tmp_path / "shared", dtype="float32",
                 batch_callback=built.append)
  assert built == [2]  # rows 4 and 2: one batch of two
  assert len(store.directories) == 2
  scratch = _build((target, head, more, d2t), tmp_path / "scratch", dtype="float32")
  index = np.array([5, 0, 3, 1, 2, 4])
  for name, values in scratch.take(index).items():
    np.testing.assert_array_equal(store.take(index)[name], values, err_msg=name)
  # Everything is found now.
  built.clear()
  _build((target, head, more, d2t), tmp_path / "shared", dtype="float32",
         batch_callback=built.append)
  assert built == []


def test_features_from_before_parts_are_reused(tiny, tmp_path):
  """A run's features in the earlier layout (one folder named by its rows and
  settings) become a part on the next run over those rows: nothing is recomputed."""
  target, head, rows, d2t = tiny
  reference = _build(tiny, tmp_path / "reference", dtype="float32")
  [part] = reference.directories
  legacy = tmp_path / "features" / features._legacy_key(target, rows, head.config.tap_layers,
                                                        d2t, "float32", 0)
  shutil.copytree(part, legacy)
  os.remove(legacy / "row_keys.npy")
  built = []
  store = _build(tiny, tmp_path / "features", dtype="float32", batch_callback=built.append)
  assert built == [] and not legacy.exists()
  index = np.arange(len(rows))
  for name, values in reference.take(index).items():
    np.testing.assert_array_equal(store.take(index)[name], values, err_msg=name)


def test_cached_training_follows_the_online_run(tmp_path):
  """float32 features: the same losses and the same trained head as running the
  target in every step (the features only move the target pass earlier)."""
  online = loop.train(overrides.load_config("tiny", OVERRIDES), str(tmp_path / "online"))
  cached_config = overrides.load_config(
      "tiny", OVERRIDES + ["data.target_features=cached", "data.features_dtype=float32"])
  cached = loop.train(cached_config, str(tmp_path / "cached"))
  assert os.listdir(tmp_path / "cached" / "features")
  assert not os.path.exists(tmp_path / "online" / "features")
  online_loss = [r["loss"] for r in online.history if r["split"] == "train"]
  cached_loss = [r["loss"] for r in cached.history if r["split"] == "train"]
  assert len(online_loss) == STEPS // 3
  # The check can fail: the head learns over these steps.
  assert online_loss[-1] < 0.9 * online_loss[0]
  np.testing.assert_allclose(cached_loss, online_loss, rtol=1e-4)
  ours = load_file(os.path.join(cached.export_dir, "model.safetensors"))
  reference = load_file(os.path.join(online.export_dir, "model.safetensors"))
  for name in reference:
    np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=2e-5, err_msg=name)
  # Evaluation is online in both runs: same held-out numbers.
  ev = [r for r in metric_records(str(tmp_path / "cached")) if r["split"] == "eval"]
  ev_online = [r for r in online.history if r["split"] == "eval"]
  np.testing.assert_allclose(ev[-1]["loss"], ev_online[-1]["loss"], rtol=1e-4)
  # A run pointed at these features (data.features_dir) computes none.
  shared = str(tmp_path / "cached" / "features")
  parts_before = sorted(os.walk(shared))
  again = loop.train(overrides.load_config(
      "tiny", OVERRIDES + ["data.target_features=cached", "data.features_dtype=float32",
                           f"data.features_dir={shared}", "steps=3"]), str(tmp_path / "again"))
  assert sorted(os.walk(shared)) == parts_before
  assert not os.path.exists(tmp_path / "again" / "features")
  np.testing.assert_allclose([r["loss"] for r in again.history if r["split"] == "train"],
                             cached_loss[:1], rtol=1e-6)


def test_cached_domino_training_follows_the_online_run(tmp_path):
  """A DFlash / Domino drafter's cached features are its context taps only (its
  labels are the data's tokens): the same losses and trained drafter as online."""
  online = loop.train(overrides.load_config("tiny_domino", OVERRIDES), str(tmp_path / "online"))
  cached = loop.train(overrides.load_config(
      "tiny_domino", OVERRIDES + ["data.target_features=cached", "data.features_dtype=float32"]),
      str(tmp_path / "cached"))
  [settings_dir] = os.listdir(tmp_path / "cached" / "features")
  [part] = os.listdir(tmp_path / "cached" / "features" / settings_dir)
  stored = os.listdir(tmp_path / "cached" / "features" / settings_dir / part)
  assert "taps.npy" in stored and not any(f.startswith("teacher") for f in stored)
  online_loss = [r["loss"] for r in online.history if r["split"] == "train"]
  cached_loss = [r["loss"] for r in cached.history if r["split"] == "train"]
  assert online_loss[-1] < 0.95 * online_loss[0]  # it learns, so the check can fail
  np.testing.assert_allclose(cached_loss, online_loss, rtol=1e-4)
  ours = load_file(os.path.join(cached.export_dir, "model.safetensors"))
  reference = load_file(os.path.join(online.export_dir, "model.safetensors"))
  for name in reference:
    np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=2e-5, err_msg=name)


def test_bad_feature_settings_are_clear_errors():
  with pytest.raises(ConfigError, match="online or cached"):
    overrides.load_config("tiny", ["data.target_features=offline"])
  with pytest.raises(ConfigError, match="float16 or float32"):
    overrides.load_config("tiny", ["data.features_dtype=bfloat16"])
  with pytest.raises(ConfigError, match="teacher_topk"):
    overrides.load_config("tiny", ["data.teacher_topk=-1"])


def test_dart_gru_loss_from_cached_features_equals_online(tiny, tmp_path):
  """DART-GRU reads the same features (its frozen head's taps and vocabulary)."""
  import jax

  from train import dart_gru_losses
  target, head, rows, d2t = tiny
  drafter = dj.DartGruDrafter.from_head(head, seed=2)
  store = _build(tiny, tmp_path, dtype="float32")
  index = np.array([1, 4])
  online = {k: np.asarray(v) for k, v in rows.take(index).items()}
  cached = {**online, **store.take(index)}

  def loss(batch):
    return dart_gru_losses.forward(
        drafter.dart_head().module(), drafter.correction_module(), target.module(), batch,
        jax.random.PRNGKey(3), num_anchors=6, level_decay=0.6)

  online_loss, (online_stats, _) = loss(online)
  cached_loss, (cached_stats, _) = loss(cached)
  assert float(online_stats.count.sum()) > 0
  np.testing.assert_allclose(float(cached_loss), float(online_loss), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(cached_stats.correct), np.asarray(online_stats.correct))


def test_domino_loss_reads_the_cached_taps(tiny, tmp_path):
  """The DFlash / Domino loss from stored taps equals the online loss, and it
  does read them: other taps give another loss."""
  import jax

  from train import dflash_losses
  from train.objectives import dflash as dflash_objective
  target, _, rows, _ = tiny
  drafter = dj.DFlashDrafter.init(target, block_size=4, num_layers=1, domino=True,
                                  target_layer_ids=(1, 3), emb_dim=16, gru_hidden_dim=12,
                                  seed=3)
  spec = dflash_objective.feature_spec(drafter)
  assert spec.d2t is None
  store = features.load_or_build(target, rows, spec.tap_layers, None, str(tmp_path),
                                 dtype="float32", batch_size=2, progress=False)
  index = np.array([0, 2])
  online = {k: np.asarray(v) for k, v in rows.take(index).items()}
  cached = {**online, **store.take(index)}
  assert set(store.take(index)) == {"taps"}

  def loss(batch):
    return dflash_losses.forward(drafter.module(), target.module(), batch,
                                 jax.random.PRNGKey(3), num_anchors=4,
                                 weights=jax.numpy.ones(3), lam=0.5)[0]

  np.testing.assert_allclose(float(loss(cached)), float(loss(online)), rtol=1e-5)
  moved = {**cached, "taps": cached["taps"][:, ::-1]}  # (a scale would be normed away)
  assert abs(float(loss(moved)) - float(loss(online))) > 1e-3
