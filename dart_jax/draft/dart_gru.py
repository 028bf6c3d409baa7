"""DART-GRU: a frozen DART head plus a Domino-style GRU correction of its levels.

DART's head drafts D+1 levels in one pass, but each level's distribution is a
marginal: it does not depend on the tokens chosen at the earlier levels of a
path. Domino's correction head (``docs/algorithms.md``, "DARTree") fixes that along
a path, and DARTree (section 3) applies it to every branch of a tree in one
batched call per depth. DART-GRU puts the two together:

- Base logits of depth d = the DART head's level d-1 logits ``[D+1, Vd]``;
  ``hid`` = the level's final hidden (what ``lm_head`` reads) ``[D+1, H]``.
- Correction: a one-layer GRU (hidden G, no bias) over the TARGET embeddings of
  the path, ``s_0 = GRU(embed(root), 0)``, ``s_d = GRU(embed(x_d), s_{d-1})``,
  and ``embed_proj`` = Linear(H+G -> E), SiLU, Linear(E -> Vd), no biases:
  ``logits_d(x | path) = base_{d-1}[x] + W2[x] . SiLU(W_z hid_{d-1} + W_s s_{d-1})``.
- Trees: ``dartree_build`` over the D+1 levels (``tree="dartree"`` pruned,
  ``"dartree-fixed"``, ``"chain"`` = the corrected greedy chain, and the
  uncorrected baselines ``"ddtree"`` / ``"dflash-chain"``), then DART's verify,
  accept and draft phases (``dart_jax.decode.dart``, the shared round).

Vocabulary: the correction lives in the DART head's DRAFT vocabulary. The
base logits only cover the Vd draft ids (the tree's candidates are always
among them), so a target-vocabulary correction would add V-Vd output rows that
can never be drafted; ``W2`` is [Vd, E] (Vd=8192 instead of 49152 for SmolLM2).
Draft id i is target id ``i + d2t[i]``; the GRU embeds target ids (the root is
a target token and need not be in the draft vocabulary), with the target's own
embedding table, which the drafter does not store.

Directory format (``save_dart_gru`` / ``load_dart_gru``): the DART head exactly
as ``save_dart`` writes it (``config.json`` + ``model.safetensors``, so
``load_dart(DIR)`` reads the head alone) plus ``correction.json`` (E, G, the
sizes it was built for) and ``correction.safetensors`` with the Domino release's
tensor names: ``prefix_gru.weight_ih_l0`` [3G, H], ``prefix_gru.weight_hh_l0``
[3G, G] (torch GRU layout, gates r, z, n), ``embed_proj.0.weight`` [E, H+G]
(inputs: the level's hidden, then the GRU state), ``embed_proj.2.weight`` [Vd, E].
"""

import dataclasses
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax import sharding as sharding_lib
from dart_jax.draft.dart_head import DartConfig, DartHead, DartHeadModule, load_dart, save_dart
from dart_jax.draft.correction import (CorrectionHead, add_correction_params,
                                       correction_head_of)
from dart_jax.draft.dflash import released_name
from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.io.safetensors_io import read_json, read_safetensors_file
from dart_jax.models import checkpoint
from dart_jax.models import precision as precision_lib
from dart_jax.models.precision import Precision
from dart_jax.tree.dartree import DARTreeConfig

CORRECTION_CONFIG = "correction.json"
CORRECTION_WEIGHTS = "correction.safetensors"
_FORMAT = "dart_jax.dart_gru"


@dataclasses.dataclass(frozen=True)
class DartGruConfig:
  """A DART head's config plus the correction's sizes (hashable: a static arg).

  emb_dim: E, width of ``embed_proj``; gru_hidden_dim: G, the GRU state size;
  pure_draft_prefix_len: the first levels use the uncorrected DART logits.
  The head's own sizes are ``dart``'s (``config.dart.draft_length``, ...).
  """

  dart: DartConfig
  emb_dim: int
  gru_hidden_dim: int
  pure_draft_prefix_len: int = 0

  def __post_init__(self):
    for name in ("emb_dim", "gru_hidden_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"DART-GRU {name} must be an int >= 1, got {value!r}")
    if not 0 <= self.pure_draft_prefix_len < self.dart.num_levels:
      raise ConfigError(f"DART-GRU pure_draft_prefix_len={self.pure_draft_prefix_len} "
                        f"must be in [0, {self.dart.num_levels}) (the head's levels)")

  def to_json(self) -> dict:
    """``correction.json``: the correction's sizes and what it was built for."""
    return {"format": _FORMAT, "vocabulary": "draft", "emb_dim": self.emb_dim,
            "gru_hidden_dim": self.gru_hidden_dim,
            "pure_draft_prefix_len": self.pure_draft_prefix_len,
            "hidden_size": self.dart.hidden_size,
            "draft_vocab_size": self.dart.draft_vocab_size,
            "num_levels": self.dart.num_levels}

  @classmethod
  def from_json(cls, raw: dict, dart: DartConfig, source: str) -> "DartGruConfig":
    """Reads ``correction.json`` and checks it against the DART head's config."""
    if raw.get("format") != _FORMAT:
      raise ConfigError(f"{source}: 'format' is {raw.get('format')!r}, expected "
                        f"{_FORMAT!r}; is this a DART-GRU correction config?")
    try:
      config = cls(dart=dart, emb_dim=int(raw["emb_dim"]),
                   gru_hidden_dim=int(raw["gru_hidden_dim"]),
                   pure_draft_prefix_len=int(raw.get("pure_draft_prefix_len", 0)))
    except KeyError as e:
      raise ConfigError(f"{source}: missing required key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
      if isinstance(e, ConfigError):
        raise
      raise ConfigError(f"{source}: malformed value: {e}") from e
    for key, have in (("hidden_size", dart.hidden_size),
                      ("draft_vocab_size", dart.draft_vocab_size),
                      ("num_levels", dart.num_levels)):
      if key in raw and int(raw[key]) != have:
        raise ConfigError(f"{source}: the correction was built for {key}={raw[key]}, but "
                          f"the DART head next to it has {have}; save the head and its "
                          "correction together (save_dart_gru)")
    return config


class CorrectionModule(nnx.Module):
  """The correction's parameters (names as in the Domino release)."""

  def __init__(self, c: DartGruConfig, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.config = c
    h = c.dart.hidden_size  # the DART hidden and the target embedding have the same size
    # Small matrices read by float32 tree-building math: compute dtype throughout.
    add_correction_params(self, h, c.gru_hidden_dim, c.emb_dim, c.dart.draft_vocab_size,
                          rngs=rngs, precision=precision_lib.resolve(precision).uniform())

  def correction_head(self, embed_table: jax.Array, hidden: jax.Array) -> CorrectionHead:
    """embed_table: [V, H] the target's; hidden: [..., D+1, H] the levels' hidden."""
    return correction_head_of(self, embed_table, hidden,
                              num_uncorrected=self.config.pure_draft_prefix_len)


class DartGruModule(nnx.Module):
  """The DART head and its correction as one module (one parameter tree)."""

  def __init__(self, config: DartGruConfig, dart: DartHeadModule,
               correction: CorrectionModule):
    self.config = config
    self.dart = dart
    self.correction = correction

  def correction_head(self, embed_table: jax.Array, hidden: jax.Array) -> CorrectionHead:
    return self.correction.correction_head(embed_table, hidden)


@dataclasses.dataclass(frozen=True, eq=False)
class DartGruDrafter:
  """A DART head + GRU correction, used functionally.

  ``generate(target, prompt, draft=drafter, tree=...)`` decodes with it; tree:
  "dartree" (pruned, default), "dartree-fixed", "chain" (the corrected greedy
  chain), or the uncorrected "ddtree" / "dflash-chain"; ``tree_config`` (a
  ``DARTreeConfig``) or its fields as keyword arguments set the tree shape.

  tree_config: the ``DARTreeConfig`` that ``generate`` starts from when it is
  given none (as ``DFlashDrafter.tree_config``); None = ``DARTreeConfig()``.
  """

  config: DartGruConfig
  graphdef: Any
  params: Any
  tree_config: DARTreeConfig | None = None

  @classmethod
  def from_head(cls, head: DartHead, *, emb_dim: int = 32, gru_hidden_dim: int = 32,
                seed: int = 0, precision=None) -> "DartGruDrafter":
    """A fresh (randomly initialised) correction on top of ``head``."""
    config = DartGruConfig(head.config, emb_dim, gru_hidden_dim)
    dart = head.module()
    correction = CorrectionModule(config, rngs=nnx.Rngs(seed),
                                  precision=precision or dart.precision)
    return cls.from_modules(config, dart, correction)

  @classmethod
  def from_modules(cls, config: DartGruConfig, dart: DartHeadModule,
                   correction: CorrectionModule) -> "DartGruDrafter":
    graphdef, params = nnx.split(DartGruModule(config, dart, correction))
    return cls(config, graphdef, params)

  def module(self) -> DartGruModule:
    return nnx.merge(self.graphdef, self.params)

  def dart_head(self) -> DartHead:
    """The DART head alone (shares the arrays)."""
    graphdef, params = nnx.split(self.module().dart)
    return DartHead(self.config.dart, graphdef, params)

  def correction_module(self) -> CorrectionModule:
    return self.module().correction

  def check_target(self, target) -> None:
    """Raises ConfigError if the DART head was built for another target."""
    self.dart_head().check_target(target)


def save_dart_gru(drafter: DartGruDrafter, path: str | os.PathLike, *, dtype=None) -> None:
  """Writes the DART head (``save_dart``'s format) and the correction into ``path``.

  dtype: store floating tensors in this numpy dtype (e.g. ``np.float16``);
  default: as they are.
  """
  import json

  from safetensors.numpy import save_file

  save_dart(drafter.dart_head(), path, dtype=dtype)
  _, correction = nnx.split(drafter.correction_module())
  tensors = checkpoint.tensors_from_state(correction, released_name)
  if dtype is not None:
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
  save_file(tensors, os.path.join(path, CORRECTION_WEIGHTS))
  with open(os.path.join(path, CORRECTION_CONFIG), "w", encoding="utf-8") as f:
    json.dump(drafter.config.to_json(), f, indent=2)


def load_dart_gru(path: str | os.PathLike, target=None, *, dtype=None) -> DartGruDrafter:
  """Loads a DART-GRU drafter written by ``save_dart_gru`` (or by
  ``python -m train.main`` with ``head.kind=dart_gru``).

  target: the ``Target`` it drafts for (checked, and it supplies the dtype);
  None skips the check. Raises CheckpointError for missing / corrupt files and
  tensors of the wrong shape, ConfigError when the correction does not fit the
  head next to it or the head does not fit the target.
  """
  directory = pathlib.Path(path).expanduser()
  head = load_dart(directory, target, dtype=dtype)
  config_path = directory / CORRECTION_CONFIG
  weights_path = directory / CORRECTION_WEIGHTS
  for file in (config_path, weights_path):
    if not file.is_file():
      raise CheckpointError(f"{file} not found: {directory} holds a DART head but not "
                            f"the DART-GRU correction ({CORRECTION_CONFIG} + "
                            f"{CORRECTION_WEIGHTS}); load it with load_dart, or train a "
                            "correction with head.kind=dart_gru")
  config = DartGruConfig.from_json(read_json(config_path, "DART-GRU correction config"),
                                   head.config, str(config_path))
  tensors = read_safetensors_file(weights_path, np.float32)
  graphdef, params = checkpoint.state_from_tensors(
      lambda: CorrectionModule(config, rngs=nnx.Rngs(0),
                               precision=precision_lib.of_drafter(dtype, target)), tensors,
      released_name, source=str(weights_path), what="DART-GRU correction")
  drafter = DartGruDrafter.from_modules(config, head.module(), nnx.merge(graphdef, params))
  return sharding_lib.drafter_on_mesh(drafter, target)
