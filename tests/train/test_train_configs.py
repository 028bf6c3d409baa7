"""Training configs: presets, JSON files, typed overrides, clear errors."""

import json
import math
import os

import numpy as np
import pytest

from dart_jax.errors import ConfigError
from train import configs, overrides, presets


def test_presets_exist_and_are_consistent():
  assert {"tiny", "smollm2_dart", "qwen3_8b_dart"} <= set(presets.PRESETS)
  tiny = overrides.load_config("tiny")
  assert os.path.isfile(os.path.join(tiny.target.path, "config.json"))
  assert all(os.path.isfile(p) for p in tiny.data.train)
  smol = overrides.load_config("smollm2_dart")
  assert smol.target.path is None  # the embedded SmolLM2 target
  assert 8192 <= smol.head.draft_vocab_size <= 16384 and smol.head.draft_length == 5
  assert all(os.path.isfile(p) for p in smol.data.train)  # the bundled self-distilled data
  assert smol.data.eval and all(os.path.isfile(p) for p in smol.data.eval)
  assert overrides.load_config("qwen3_8b_dart").target.path == configs.REQUIRED


def test_dflash_presets_and_config_errors():
  for name, kind in [("tiny_dflash", "dflash"), ("tiny_domino", "domino"),
                     ("smollm2_domino", "domino"), ("qwen3_8b_dflash", "dflash"),
                     ("qwen3_8b_domino", "domino")]:
    c = overrides.load_config(name)
    assert c.head.kind == kind, name
  smol = overrides.load_config("smollm2_domino")
  assert smol.target.path is None and smol.dflash.num_layers in (1, 2)
  assert 6 <= smol.dflash.block_size <= 10
  qwen = overrides.load_config("qwen3_8b_domino")
  assert qwen.target.path == configs.REQUIRED and qwen.dflash.block_size == 16
  assert (qwen.dflash.emb_dim, qwen.dflash.gru_hidden_dim) == (256, 1024)
  c = overrides.load_config("tiny", ["head.kind=domino", "dflash.block_size=6",
                                   "dflash.target_layer_ids=0,2", "loss.position_gamma=inf"])
  assert c.dflash.target_layer_ids == (0, 2) and math.isinf(c.loss.position_gamma)
  for override, message in [("head.kind=eagle", "head.kind must be one of"),
                            ("dflash.block_size=1", "block_size must be >= 2"),
                            ("loss.domino_anneal=2", "domino_anneal"),
                            ("loss.domino_floor=-0.1", "domino_floor"),
                            ("dflash.blok_size=8", "did you mean 'block_size'"),
                            ("head.init_from=/x", "dflash.init_from")]:
    with pytest.raises(ConfigError, match=message):
      overrides.load_config("tiny_domino", [override])


def test_smollm2_domino_stages_continue_each_other():
  v3, v4 = (overrides.load_config(f"smollm2_domino_v{i}") for i in (3, 4))
  assert v3.dflash == v4.dflash and v4.dflash.init_from == configs.REQUIRED
  # v4's rows start with v3's (same files, order and packing), so v3's cached taps serve them.
  assert (v4.data.train, v4.data.max_len, v4.data.pack) == (v3.data.train, v3.data.max_len,
                                                           v3.data.pack)
  assert v4.data.max_examples == 2 * v3.data.max_examples
  assert v4.data.eval == v3.data.eval
  assert 0 < v4.loss.domino_floor < v3.loss.domino_floor


def test_overrides_are_parsed_with_the_field_types():
  c = overrides.load_config("tiny", [
      "optim.learning_rate=1e-3", "steps=7", "progress=false", "data.train=a.jsonl,b.jsonl",
      "head.init_from=none", "target.path=/x", "loss.level_decay=0.5", "mesh.fsdp=2"])
  assert c.optim.learning_rate == 1e-3 and isinstance(c.optim.learning_rate, float)
  assert c.steps == 7 and c.progress is False
  assert c.data.train == ("a.jsonl", "b.jsonl")
  assert c.head.init_from is None and c.target.path == "/x"
  assert c.loss.level_decay == 0.5 and c.mesh.fsdp == 2
  assert c.batch_size == presets.PRESETS["tiny"].batch_size  # untouched


@pytest.mark.parametrize("override, message", [
    ("optim.learnig_rate=1e-3", "did you mean 'learning_rate'"),
    ("stepz=3", "did you mean 'steps'"),
    ("optimizer.learning_rate=1", "unknown config key 'optimizer'"),
    ("steps=ten", "expected int"),
    ("progress=maybe", "expected bool"),
    ("optim=3", "is a section"),
    ("steps", "not key=value"),
    ("steps=0", "steps must be positive"),
    ("compute_dtype=float16", "compute_dtype must be"),
    ("target.dtype=fp8", "target.dtype must be auto or one of"),
])
def test_bad_overrides_are_clear_errors(override, message):
  with pytest.raises(ConfigError, match=message):
    overrides.load_config("tiny", [override])


def test_target_precision_modes_are_accepted():
  for mode in ("auto", "fast", "fast-rows", "float32", "bfloat16"):
    assert overrides.load_config("tiny", [f"target.dtype={mode}"]).target.dtype == mode


def test_json_config_file_with_base_preset(tmp_path):
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"base": "tiny", "steps": 12, "optim": {"learning_rate": 0.002},
                              "data": {"train": ["x.jsonl"]}}))
  c = overrides.load_config(str(path), ["batch_size=4"])
  assert c.steps == 12 and c.optim.learning_rate == 0.002 and c.data.train == ("x.jsonl",)
  assert c.batch_size == 4 and c.head == presets.PRESETS["tiny"].head
  path.write_text(json.dumps({"base": "tiny", "optim": {"warmup_stpes": 3}}))
  with pytest.raises(ConfigError, match="optim.warmup_stpes.*did you mean 'warmup_steps'"):
    overrides.load_config(str(path))
  path.write_text(json.dumps({"steps": "many"}))
  with pytest.raises(ConfigError, match="steps"):
    overrides.load_config(str(path))
  path.write_text("{broken")
  with pytest.raises(ConfigError, match="cannot read config file"):
    overrides.load_config(str(path))


def test_unknown_preset_suggests_the_closest():
  with pytest.raises(ConfigError, match="did you mean 'tiny'"):
    overrides.load_config("tinny")


def test_required_target_path_is_reported_before_loading():
  from train import loop

  with pytest.raises(ConfigError, match="target.path"):
    loop._load_target(overrides.load_config("qwen3_8b_dart"))


def test_bundled_self_distilled_eval_is_held_out():
  """No user prompt of the held-out conversations occurs in the training ones."""
  import json

  def first_prompts(path):
    with open(path) as f:
      return {json.dumps(json.loads(line)["messages"][0]) for line in f}

  train = first_prompts(configs.SMOLLM2_SELF_DISTILLED)
  held_out = first_prompts(configs.SMOLLM2_SELF_DISTILLED_EVAL)
  assert len(train) > 900 and len(held_out) == 64
  assert not train & held_out


def test_the_v2_preset_continues_from_the_shipped_head(smollm2):
  import dart_jax as dj
  from train.objectives import dart as dart_objective

  config = overrides.load_config("smollm2_dart_v2", [])
  assert config.head.init_from == dart_objective.EMBEDDED
  assert config.data.train == configs.SMOLLM2_V2_TRAIN
  assert config.data.eval == (configs.SMOLLM2_V2_HELDOUT,)
  head = dart_objective.make(config, smollm2, rows=None)
  shipped = dj.load_dart(None, smollm2)
  assert head.config == shipped.config
  np.testing.assert_array_equal(np.asarray(head.params["d2t"][...]),
                                np.asarray(shipped.params["d2t"][...]))
