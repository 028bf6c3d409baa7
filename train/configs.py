"""Typed training configurations: the schema (``TrainConfig`` and its sections).

Presets are registered in ``train/presets.py``; ``train/overrides.py`` reads a
preset or JSON file and applies ``key=value`` overrides (``load_config``).

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
import os

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
# The v2 self-distilled data (train/README.md, "The v2 data"), xz-compressed.
SMOLLM2_V2_DIR = os.path.join(SAMPLE_DATA_DIR, "smollm2_v2")
# The sampled answers are bundled in two files: batches 60-68 of the plan (what
# stages 5-7 and the shipped N-gram used) and the batches from 69 on.
SMOLLM2_V2_TRAIN = (os.path.join(SMOLLM2_V2_DIR, "train_greedy.jsonl.xz"),
                    os.path.join(SMOLLM2_V2_DIR, "train_sampled.jsonl.xz"),
                    os.path.join(SMOLLM2_V2_DIR, "train_sampled_from_69.jsonl.xz"))
SMOLLM2_V2_HELDOUT = os.path.join(SMOLLM2_V2_DIR, "heldout_greedy.jsonl.xz")
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
  init_from: a DART head directory to continue from (reference format), or
    "embedded": the head shipped for the embedded target. For dart_gru: the frozen head to correct (default: the head shipped for the
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
  max_examples: use only the first N records in file order (0 = all). The
    bundled v2 files are in the regeneration plan's order, by prompt length,
    so their first N records are the shortest prompts, not a sample.
  cache: cache tokenized rows under ``WORKDIR/data_cache``.
  target_features: "online" runs the frozen target in every step; "cached"
    runs it once per training row and stores what the loss reads under
    ``features_dir`` (DART, DART-GRU: taps, teacher log-probs over the draft
    vocabulary, teacher argmax; DFlash / Domino: the context taps), so later
    epochs cost only the drafter (``train/features.py``). Evaluation stays
    online.
  features_dir: where cached features live; "" = ``WORKDIR/features``. Runs
    that share one reuse each other's rows (found by content), so a run over
    more data computes only the new rows.
  features_dtype: storage of the cached taps and log-probs: float16 (half the
    disk) or float32 (the online step's numbers exactly).
  teacher_topk: with cached features, K > 0 keeps only each position's K most
    likely draft ids of the teacher (the rest share the remaining mass; about
    Vd / K times less teacher storage); 0 keeps all Vd.
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
  features_dir: str = ""
  teacher_topk: int = 0


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
    l decayed linearly 1 -> 0 over this fraction of the steps (0: l = 0), but
    never below ``domino_floor``.
  domino_floor: Domino: l never falls below this. The spec anneals l to 0, which
    stops training the base marginals; DARTree draws its candidate table from
    their top-K, so a floor keeps them useful (issue #20).
  """

  num_anchors: int = 64
  level_decay: float = 0.6
  position_gamma: float = 0.0
  domino_anneal: float = 0.5
  domino_floor: float = 0.0


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
    The head with the best held-out ``accept_len`` so far is also exported, to
    ``WORKDIR/best`` (``WORKDIR/best.json`` says its step and score).
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
    if self.data.teacher_topk < 0:
      raise ConfigError(f"data.teacher_topk must be >= 0 (0 = the whole teacher), got "
                        f"{self.data.teacher_topk}")
    if self.data.features_dtype not in ("float16", "float32"):
      raise ConfigError(f"data.features_dtype must be float16 or float32, got "
                        f"{self.data.features_dtype!r}")
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
    if not 0 <= self.loss.domino_floor <= 1:
      raise ConfigError(f"loss.domino_floor must be in [0, 1], got "
                        f"{self.loss.domino_floor}")


def to_dict(config: TrainConfig) -> dict:
  """JSON-serialisable form (written next to checkpoints)."""
  return dataclasses.asdict(config)
