"""Typed training configurations: presets, JSON files and ``key=value`` overrides.

A config is a frozen ``TrainConfig`` made of sections (``target``, ``head``,
``dflash``, ``data``, ``loss``, ``optim``, ``mesh``) plus top-level run settings.
``head.kind`` picks the drafter: "dart" (a DART head, ``head`` section), "dflash"
or "domino" (a DFlash drafter, with the Domino correction head for "domino";
``dflash`` section), or "dart_gru" (a GRU correction trained on a frozen DART
head: ``head.init_from``, ``head.emb_dim``, ``head.gru_hidden_dim``). Select one with ``--config NAME_OR_FILE``: a preset name
(see ``PRESETS``) or a JSON file whose nested keys mirror the dataclasses and
may name a preset to start from with ``"base": "tiny"``. Overrides use dotted
keys: ``optim.learning_rate=1e-3 steps=200 data.train=a.jsonl,b.jsonl``.
Unknown keys are errors (with the closest valid key suggested).
"""

import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any, Mapping, Sequence

from dart_jax.decode.methods import DRAFTER_KINDS
from dart_jax.errors import ConfigError
from dart_jax.models import precision

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_DATA_DIR = os.path.join(REPO_ROOT, "train", "sample_data")
SAMPLE_DATA = (os.path.join(SAMPLE_DATA_DIR, "chat_sharegpt.jsonl"),
               os.path.join(SAMPLE_DATA_DIR, "chat_openai.jsonl"))
TINY_TARGET = os.path.join(SAMPLE_DATA_DIR, "tiny_target")
# SmolLM2-135M-Instruct's own answers to train.prompts (seed 0), see the preset:
# 1024 conversations for training and a held-out batch of 64 for evaluation.
SMOLLM2_SELF_DISTILLED = os.path.join(SAMPLE_DATA_DIR, "smollm2_self_distilled.jsonl")
SMOLLM2_SELF_DISTILLED_EVAL = os.path.join(SAMPLE_DATA_DIR,
                                           "smollm2_self_distilled_eval.jsonl")
# The first 192 conversations: the data of the documented Domino and DART-GRU runs.
SMOLLM2_FIRST_BATCHES = 192
REQUIRED = "REQUIRED"  # A path the user must set (no sensible default exists).


@dataclasses.dataclass(frozen=True)
class TargetSection:
  """The frozen target model.

  path: HF directory, ``.gguf`` file, or None for the embedded SmolLM2-135M.
  dtype: the target's numeric mode (``dart_jax.models.precision``): "auto" (the
    fast mode on CPU, bfloat16 on TPU/GPU), "fast", "fast-rows" (bf16-rounded
    rows: fastest for features, numerics need not match decoding), "float32" or
    "bfloat16".
  """

  path: str | None = None
  dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class HeadSection:
  """Which drafter is trained, and the DART head's shape.

  kind: "dart" (a DART head, the fields below), "dflash" or "domino" (a DFlash
    drafter without / with the Domino correction head: the ``dflash`` section),
    "dart_gru" (a GRU correction of a frozen DART head's levels).
  draft_length: D mask slots (D+1 draft levels).
  draft_vocab_size: Vd; 0 = the whole target vocabulary.
  init_from: a DART head directory to continue from (reference format). For
    dart_gru: the frozen head to correct (default: the head shipped for the
    embedded target), or a DART-GRU directory to continue; the head fixes D
    and Vd (``draft_length`` / ``draft_vocab_size`` are then unused).
  emb_dim, gru_hidden_dim: dart_gru: the correction's E and G.
  """

  kind: str = "dart"
  draft_length: int = 6
  draft_vocab_size: int = 16384
  double_norm: bool = True
  init_from: str | None = None
  emb_dim: int = 128
  gru_hidden_dim: int = 256


@dataclasses.dataclass(frozen=True)
class DFlashSection:
  """The DFlash / Domino drafter (``head.kind`` "dflash" / "domino";
  ``docs/algorithms.md``, "DARTree"). Heads and head_dim follow the target.

  block_size: B, the root plus B-1 mask slots (B-1 draft depths).
  num_layers: drafter layers (Qwen3-style).
  target_layer_ids: target layers whose outputs form the context feature;
    empty = DFlash's rule ``round(1 + i*(L-4)/(n-1))`` with n = ``num_taps``.
  num_taps: taps for that rule; 0 = ``num_layers`` (as DFlash does).
  intermediate_size: drafter MLP width; 0 = the target's.
  mask_token_id: the MASK token (embedded with the target's table); -1 = the
    last vocabulary id.
  emb_dim, gru_hidden_dim: the Domino head's E and G.
  init_from: a DFlash / Domino directory (released format) to continue from; its
    config.json fixes the architecture. A plain DFlash directory with
    ``head.kind=domino`` gets a fresh Domino head on its backbone.
  """

  block_size: int = 16
  num_layers: int = 5
  target_layer_ids: tuple[int, ...] = ()
  num_taps: int = 0
  intermediate_size: int = 0
  mask_token_id: int = -1
  emb_dim: int = 256
  gru_hidden_dim: int = 1024
  init_from: str | None = None


@dataclasses.dataclass(frozen=True)
class DataSection:
  """Training data.

  train: JSONL files (ShareGPT ``conversations``, OpenAI ``messages`` or ``text``).
  eval: held-out JSONL files; empty = hold out ``eval_fraction`` of ``train``.
  max_len: tokens per row; longer conversations are truncated.
  pack: pack several conversations per row (segment-isolated attention).
  max_examples: use only the first N records (0 = all).
  cache: cache tokenized rows under ``WORKDIR/data_cache``.
  target_features: "online" runs the frozen target in every step; "cached"
    (DART and DART-GRU) runs it once per training row and stores what the
    loss reads (taps, teacher log-probs over the draft vocabulary, teacher
    argmax) under ``WORKDIR/features``, so later epochs cost only the head
    (``train/features.py``). Evaluation stays online.
  features_dtype: storage of the cached taps and log-probs: float16 (half the
    disk) or float32 (the online step's numbers exactly).
  """

  train: tuple[str, ...] = SAMPLE_DATA
  eval: tuple[str, ...] = ()
  eval_fraction: float = 0.05
  max_len: int = 1024
  pack: bool = True
  shuffle_seed: int = 0
  max_examples: int = 0
  cache: bool = True
  target_features: str = "online"
  features_dtype: str = "float16"


@dataclasses.dataclass(frozen=True)
class LossSection:
  """The training objective (``train/losses.py``, ``train/dflash_losses.py``).

  num_anchors: anchors (DFlash: blocks) per row, drawn at random among positions
    with a loss target; 0 = every position is an anchor.
  level_decay: DART: level k is weighted ``level_decay ** k``.
  position_gamma: DFlash / Domino: block slot k (1..B-1) is weighted
    ``exp(-(k-1)/gamma)``; 0 = by block size (DFlash: 7 for B=16, 5 for 10,
    4 for 8, else (B-1)/2); ``inf`` = uniform.
  domino_anneal: Domino: the loss is ``(1-l)*CE(corrected) + l*CE(base)`` with
    l decayed linearly 1 -> 0 over this fraction of the steps (0: l = 0).
  """

  num_anchors: int = 64
  level_decay: float = 0.6
  position_gamma: float = 0.0
  domino_anneal: float = 0.5


@dataclasses.dataclass(frozen=True)
class OptimSection:
  """AdamW with linear warmup, cosine decay and global-norm clipping.

  The paper publishes no optimizer settings; these are EAGLE-style defaults.
  end_lr_ratio: final learning rate as a fraction of the peak.
  """

  learning_rate: float = 5e-4
  warmup_steps: int = 200
  end_lr_ratio: float = 0.05
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_norm: float = 0.5


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """Device mesh (data, fsdp, tensor); -1 = all devices the others leave."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run.

  steps: optimizer steps; batch_size: rows per step over all processes.
  param_dtype: master copy of the head's parameters.
  compute_dtype: "auto" (target dtype), "float32" or "bfloat16" for the head's
    forward (loss and softmax always in float32).
  attn_impl: tree_attention implementation for training passes; "xla" is the
    differentiable one.
  export_dir: where the final head is written (default ``WORKDIR/export``).
  distributed: "auto" tries ``jax.distributed.initialize()`` and takes the
    ValueError of a single host as "single host"; "on" / "off" force it.
  """

  target: TargetSection = TargetSection()
  head: HeadSection = HeadSection()
  dflash: DFlashSection = DFlashSection()
  data: DataSection = DataSection()
  loss: LossSection = LossSection()
  optim: OptimSection = OptimSection()
  mesh: MeshSection = MeshSection()
  steps: int = 1000
  batch_size: int = 16
  seed: int = 0
  param_dtype: str = "float32"
  compute_dtype: str = "auto"
  attn_impl: str = "xla"
  log_every: int = 10
  eval_every: int = 200
  eval_batches: int = 8
  checkpoint_every: int = 200
  keep_checkpoints: int = 2
  export_dir: str | None = None
  progress: bool = True
  distributed: str = "auto"

  def __post_init__(self):
    for name in ("steps", "batch_size", "log_every", "eval_every", "checkpoint_every"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"{name} must be auto, float32 or bfloat16, got "
                          f"{getattr(self, name)!r}")
    if self.target.dtype != "auto" and self.target.dtype not in precision.NAMES:
      raise ConfigError(f"target.dtype must be auto or one of {', '.join(precision.NAMES)}, "
                        f"got {self.target.dtype!r}")
    if self.distributed not in ("auto", "on", "off"):
      raise ConfigError(f"distributed must be auto, on or off, got {self.distributed!r}")
    if self.head.kind not in DRAFTER_KINDS:
      raise ConfigError(f"head.kind must be one of {', '.join(DRAFTER_KINDS)}, got "
                        f"{self.head.kind!r}")
    if self.data.target_features not in ("online", "cached"):
      raise ConfigError(f"data.target_features must be online or cached, got "
                        f"{self.data.target_features!r}")
    if self.data.features_dtype not in ("float16", "float32"):
      raise ConfigError(f"data.features_dtype must be float16 or float32, got "
                        f"{self.data.features_dtype!r}")
    if self.data.target_features == "cached" and self.head.kind not in ("dart", "dart_gru"):
      raise ConfigError(f"data.target_features=cached is for DART heads (head.kind=dart "
                        f"or dart_gru); a {self.head.kind} drafter reads the target "
                        "online")
    if not 0 <= self.data.eval_fraction < 1:
      raise ConfigError(f"data.eval_fraction must be in [0, 1), got "
                        f"{self.data.eval_fraction}")
    if self.head.kind == "dart_gru":
      for name in ("emb_dim", "gru_hidden_dim"):
        if getattr(self.head, name) < 1:
          raise ConfigError(f"head.{name} must be >= 1, got {getattr(self.head, name)}")
      if self.data.max_len < 4:
        raise ConfigError(f"data.max_len={self.data.max_len} is too short for DART-GRU")
      return
    if self.head.kind == "dart":
      if self.head.draft_length < 1:
        raise ConfigError(f"head.draft_length must be >= 1, got {self.head.draft_length}")
      if self.data.max_len < self.head.draft_length + 3:
        raise ConfigError(f"data.max_len={self.data.max_len} is too short for "
                          f"draft_length={self.head.draft_length}")
      return
    if self.head.init_from:
      raise ConfigError(f"head.init_from is for DART heads; a {self.head.kind} drafter "
                        "continues from dflash.init_from=DIR")
    d = self.dflash
    if d.block_size < 2:
      raise ConfigError(f"dflash.block_size must be >= 2 (the root plus one mask "
                        f"slot), got {d.block_size}")
    for name in ("num_layers", "emb_dim", "gru_hidden_dim"):
      if getattr(d, name) < 1:
        raise ConfigError(f"dflash.{name} must be >= 1, got {getattr(d, name)}")
    if self.data.max_len < d.block_size + 1:
      raise ConfigError(f"data.max_len={self.data.max_len} is too short for "
                        f"dflash.block_size={d.block_size}")
    if not self.loss.position_gamma >= 0:
      raise ConfigError(f"loss.position_gamma must be >= 0 (0 = by block size), got "
                        f"{self.loss.position_gamma}")
    if not 0 <= self.loss.domino_anneal <= 1:
      raise ConfigError(f"loss.domino_anneal must be in [0, 1], got "
                        f"{self.loss.domino_anneal}")


PRESETS: dict[str, TrainConfig] = {
    # A head for the bundled tiny Llama (vocab 320, 4 layers, hidden 64; trained
    # on the sample chats by sample_data/make_tiny_target.py) on the bundled
    # sample chats, through the real tokenizer / chat-template path. About a
    # minute on 2 CPU cores.
    "tiny": TrainConfig(
        target=TargetSection(path=TINY_TARGET, dtype="float32"),
        head=HeadSection(draft_length=3, draft_vocab_size=256),
        data=DataSection(max_len=128, eval_fraction=0.05),
        loss=LossSection(num_anchors=32),
        optim=OptimSection(learning_rate=1e-2, warmup_steps=10, end_lr_ratio=0.1,
                           clip_norm=1.0),
        steps=200, batch_size=8, log_every=10, eval_every=100, eval_batches=2,
        checkpoint_every=50,
    ),
    # SmolLM2-135M-Instruct (the embedded default target) on a 2-core CPU budget.
    # Data (deterministic: greedy answers, seeded prompts):
    #   python -m train.prompts --num 1600 --seed 0 --out prompts.jsonl
    #   python -m train.data regenerate --data prompts.jsonl --out regen.jsonl \
    #       --max-new-tokens 160 --batch-size 64 --max-batches 17
    # bundled as SMOLLM2_SELF_DISTILLED (batches 1-10 and 12-17) and
    # SMOLLM2_SELF_DISTILLED_EVAL (batch 11, held out). The target runs once per
    # training row (cached features, ~25 min), then 600 head-only steps (~25 min).
    # The shipped head is this run continued from earlier stages, see
    # dart_jax/assets/smollm2_135m/README.md. On a TPU/GPU raise steps, batch_size,
    # max_len and the amount of regenerated data.
    "smollm2_dart": TrainConfig(
        target=TargetSection(path=None),
        head=HeadSection(draft_length=5, draft_vocab_size=8192),
        data=DataSection(train=(SMOLLM2_SELF_DISTILLED,), eval=(SMOLLM2_SELF_DISTILLED_EVAL,),
                         max_len=512, eval_fraction=0.0, target_features="cached"),
        loss=LossSection(num_anchors=64),
        optim=OptimSection(learning_rate=1e-3, warmup_steps=20, end_lr_ratio=0.1),
        steps=600, batch_size=4, log_every=10, eval_every=150, eval_batches=4,
        checkpoint_every=50,
    ),
    # Qwen3-8B on a TPU pod slice: shard the target over fsdp, bfloat16 compute.
    "qwen3_8b_dart": TrainConfig(
        target=TargetSection(path=REQUIRED, dtype="bfloat16"),
        head=HeadSection(draft_length=7, draft_vocab_size=32000),
        data=DataSection(max_len=2048),
        loss=LossSection(num_anchors=256),
        optim=OptimSection(learning_rate=3e-4, warmup_steps=1000),
        mesh=MeshSection(data=1, fsdp=-1, tensor=1),
        steps=40000, batch_size=64, compute_dtype="bfloat16", eval_every=2000,
        checkpoint_every=1000,
    ),
}


_TINY = PRESETS["tiny"]
PRESETS.update({
    # DFlash / Domino drafters for the bundled tiny target (context = outputs of
    # target layers 1 and 3; block of 4 = 3 draft depths). About a minute on 2
    # CPU cores each.
    "tiny_dflash": dataclasses.replace(
        _TINY, head=HeadSection(kind="dflash"),
        dflash=DFlashSection(block_size=4, num_layers=1, target_layer_ids=(1, 3),
                             intermediate_size=128),
        loss=LossSection(num_anchors=32),
        optim=OptimSection(learning_rate=2e-2, warmup_steps=10, end_lr_ratio=0.1,
                           clip_norm=1.0)),
    "tiny_domino": dataclasses.replace(
        _TINY, head=HeadSection(kind="domino"),
        dflash=DFlashSection(block_size=4, num_layers=1, target_layer_ids=(1, 3),
                             intermediate_size=128, emb_dim=32, gru_hidden_dim=32),
        loss=LossSection(num_anchors=32, domino_anneal=0.5),
        optim=OptimSection(learning_rate=2e-2, warmup_steps=10, end_lr_ratio=0.1,
                           clip_norm=1.0)),
    # A Domino drafter for SmolLM2-135M-Instruct (30 layers, hidden 576) on a
    # 2-core CPU budget, on the first 192 bundled self-distilled conversations:
    # one draft layer reading target layers 1, 14, 27 (DFlash's rule for 3 taps),
    # block of 6 = 5 draft depths (DART's D). On a TPU/GPU raise steps,
    # batch_size, max_len, num_layers and block_size with the amount of data.
    "smollm2_domino": TrainConfig(
        target=TargetSection(path=None),
        head=HeadSection(kind="domino"),
        dflash=DFlashSection(block_size=6, num_layers=1, num_taps=3, emb_dim=128,
                             gru_hidden_dim=256),
        data=DataSection(train=(SMOLLM2_SELF_DISTILLED,), max_examples=SMOLLM2_FIRST_BATCHES,
                         max_len=512, eval_fraction=0.05),
        loss=LossSection(num_anchors=32, domino_anneal=0.5),
        optim=OptimSection(learning_rate=1e-3, warmup_steps=10, end_lr_ratio=0.1),
        steps=150, batch_size=4, log_every=5, eval_every=75, eval_batches=2,
        checkpoint_every=25,
    ),
    # Qwen3-8B (36 layers) on a TPU pod slice, the released drafters' shape: 5
    # layers reading target layers 1, 9, 17, 25, 33, block of 16. Domino:
    # E=256, G=1024; dflash.init_from=/path/to/Qwen3-8B-DFlash-b16 trains a
    # Domino head on a released DFlash backbone.
    "qwen3_8b_dflash": TrainConfig(
        target=TargetSection(path=REQUIRED, dtype="bfloat16"),
        head=HeadSection(kind="dflash"),
        dflash=DFlashSection(block_size=16, num_layers=5),
        data=DataSection(max_len=2048),
        loss=LossSection(num_anchors=64),
        optim=OptimSection(learning_rate=6e-4, warmup_steps=1000),
        mesh=MeshSection(data=1, fsdp=-1, tensor=1),
        steps=40000, batch_size=64, compute_dtype="bfloat16", eval_every=2000,
        checkpoint_every=1000,
    ),
})
PRESETS["qwen3_8b_domino"] = dataclasses.replace(
    PRESETS["qwen3_8b_dflash"], head=HeadSection(kind="domino"),
    dflash=DFlashSection(block_size=16, num_layers=5, emb_dim=256, gru_hidden_dim=1024))
PRESETS.update({
    # DART-GRU: a GRU correction of a frozen DART head's levels. Tiny target: set
    # head.init_from=DIR to a DART head for it (e.g. the export of --config tiny).
    "tiny_dart_gru": dataclasses.replace(
        _TINY, head=HeadSection(kind="dart_gru", emb_dim=32, gru_hidden_dim=32),
        loss=LossSection(num_anchors=32),
        optim=OptimSection(learning_rate=1e-2, warmup_steps=10, end_lr_ratio=0.1,
                           clip_norm=1.0)),
    # SmolLM2-135M-Instruct: the correction (E=128, G=256) of the head shipped in
    # dart_jax/assets/smollm2_135m (default head.init_from), on the first 192
    # bundled self-distilled conversations.
    "smollm2_dart_gru": TrainConfig(
        target=TargetSection(path=None),
        head=HeadSection(kind="dart_gru", emb_dim=128, gru_hidden_dim=256),
        data=DataSection(train=(SMOLLM2_SELF_DISTILLED,), max_examples=SMOLLM2_FIRST_BATCHES,
                         max_len=512, eval_fraction=0.05),
        loss=LossSection(num_anchors=64),
        optim=OptimSection(learning_rate=1e-3, warmup_steps=10, end_lr_ratio=0.1),
        steps=80, batch_size=4, log_every=5, eval_every=40, eval_batches=2,
        checkpoint_every=20,
    ),
})


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _suggest(name: str, options: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, list(options), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_value(text: str, kind: Any, key: str) -> Any:
  """Parses an override string into ``kind`` (int, float, bool, str, tuples, Optional)."""
  origin = typing.get_origin(kind)
  args = typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    if text.lower() in ("none", "null", ""):
      if type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    return _parse_value(text, inner[0], key)
  if origin is tuple:
    return tuple(_parse_value(part, args[0], key) for part in text.split(",") if part)
  try:
    if kind is bool:
      lowered = text.lower()
      if lowered in ("true", "1", "yes", "on"):
        return True
      if lowered in ("false", "0", "no", "off"):
        return False
      raise ValueError(text)
    if kind is int:
      return int(text)
    if kind is float:
      return float(text)
    if kind is str:
      return text
  except ValueError:
    raise ConfigError(f"bad value {text!r} for {key}: expected {kind.__name__}") from None
  raise ConfigError(f"cannot parse {key} of type {kind}")


def _coerce(value: Any, kind: Any, key: str) -> Any:
  """Checks / converts a JSON value to a field type."""
  if isinstance(value, str) and kind is not str and not (
      typing.get_origin(kind) in (typing.Union, types.UnionType) and str in typing.get_args(kind)):
    return _parse_value(value, kind, key)
  origin = typing.get_origin(kind)
  if origin is tuple:
    if isinstance(value, str):
      return (value,)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key} must be a list, got {value!r}")
    return tuple(value)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise ConfigError(f"{key} must be an integer, got {value!r}")
  if kind is bool and not isinstance(value, bool):
    raise ConfigError(f"{key} must be true or false, got {value!r}")
  return value


def _check_known(name: str, key: str, types_: Mapping[str, Any]) -> None:
  """Raises ConfigError for a config key that does not exist (with a suggestion)."""
  if name not in types_:
    raise ConfigError(f"unknown config key {key!r}{_suggest(name, list(types_))}; "
                      f"valid keys here: {', '.join(sorted(types_))}")


def _replace_nested(obj: Any, updates: Mapping[str, Any], prefix: str = "") -> Any:
  """``dataclasses.replace`` for nested sections; values may be dicts for sections."""
  types_ = _field_types(type(obj))
  changes = {}
  for name, value in updates.items():
    key = prefix + name
    _check_known(name, key, types_)
    kind = types_[name]
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
      if not isinstance(value, Mapping):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
      changes[name] = _replace_nested(current, value, key + ".")
    else:
      changes[name] = _coerce(value, kind, key)
  return dataclasses.replace(obj, **changes)


def parse_overrides(overrides: Sequence[str]) -> dict:
  """``["a.b=1", "c=x"]`` -> ``{"a": {"b": "1"}, "c": "x"}`` (values still strings)."""
  nested: dict = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not key=value (e.g. optim.learning_rate=1e-3)")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = nested
    for part in parts[:-1]:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {item!r} conflicts with an earlier one")
    node[parts[-1]] = value
  return nested


def _resolve_strings(tree: dict, config: TrainConfig) -> dict:
  """Parses string override values with the field types of ``config``."""
  def walk(obj, updates, prefix):
    types_ = _field_types(type(obj))
    out = {}
    for name, value in updates.items():
      key = prefix + name
      _check_known(name, key, types_)
      current = getattr(obj, name)
      if isinstance(value, dict):
        if not dataclasses.is_dataclass(current):
          raise ConfigError(f"{key} is not a section")
        out[name] = walk(current, value, key + ".")
      elif dataclasses.is_dataclass(current):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
      else:
        out[name] = _parse_value(value, types_[name], key)
    return out
  return walk(config, tree, "")


def load_config(name_or_file: str, overrides: Sequence[str] = ()) -> TrainConfig:
  """A preset or JSON file, with ``key=value`` overrides applied.

  Raises ConfigError for unknown presets, unreadable files, unknown keys and
  values of the wrong type.
  """
  if name_or_file in PRESETS:
    config = PRESETS[name_or_file]
  elif os.path.isfile(name_or_file):
    try:
      with open(name_or_file, encoding="utf-8") as f:
        raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"cannot read config file {name_or_file!r}: {e}") from e
    if not isinstance(raw, dict):
      raise ConfigError(f"config file {name_or_file!r} must hold a JSON object")
    base = raw.pop("base", None)
    if base is not None and base not in PRESETS:
      raise ConfigError(f"config file {name_or_file!r}: unknown base preset {base!r}; "
                        f"presets: {', '.join(PRESETS)}")
    config = _replace_nested(PRESETS[base] if base else TrainConfig(), raw)
  else:
    raise ConfigError(f"--config {name_or_file!r} is neither a preset "
                      f"({', '.join(PRESETS)}) nor an existing JSON file"
                      f"{_suggest(name_or_file, list(PRESETS))}")
  if overrides:
    config = _replace_nested(config, _resolve_strings(parse_overrides(overrides), config))
  return config


def to_dict(config: TrainConfig) -> dict:
  """JSON-serialisable form (written next to checkpoints)."""
  return dataclasses.asdict(config)
