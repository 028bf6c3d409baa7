"""DART-GRU's objective (``head.kind=dart_gru``): a GRU correction trained on a
frozen DART head's levels (``train/dart_gru_losses.py``); exported with
``save_dart_gru`` (``save_dart``'s head plus the correction)."""

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

import dart_jax as dj
from dart_jax.draft.dart_gru import (CORRECTION_CONFIG, CorrectionModule, DartGruConfig,
                                     DartGruDrafter)
from dart_jax.draft.dart_head import DartHead
from dart_jax.errors import ConfigError
from train import dart_gru_losses
from train.features import FeatureSpec
from train.objectives import dart

log = logging.getLogger(__name__)

KINDS = ("dart_gru",)
CONFIG_TYPE = DartGruConfig


def make(config, target, rows=None) -> DartGruDrafter:
  """The frozen DART head (``head.init_from``, default the one shipped for the
  embedded target) with a fresh correction, or a DART-GRU directory to continue."""
  del rows
  hc = config.head
  if hc.init_from and os.path.isfile(os.path.join(hc.init_from, CORRECTION_CONFIG)):
    log.info("continuing from the DART-GRU drafter in %s", hc.init_from)
    return dj.load_dart_gru(hc.init_from, target)
  if hc.init_from:
    head = dj.load_dart(hc.init_from, target)
  elif config.target.path is None:
    head = dj.load_dart(None, target)  # the head shipped for the embedded target
  else:
    raise ConfigError("head.kind=dart_gru corrects a trained DART head: set "
                      "head.init_from=DIR (a DART head for this target, e.g. the export "
                      "of a head.kind=dart run)")
  log.info("correcting the frozen DART head from %s", hc.init_from or "dart_jax's assets")
  return DartGruDrafter.from_head(head, emb_dim=hc.emb_dim, gru_hidden_dim=hc.gru_hidden_dim,
                                  seed=config.seed)


def step_options(config, drafter: DartGruDrafter) -> dict:
  del config, drafter
  return {}


def split(drafter: DartGruDrafter, param_dtype) -> tuple[dict, dict]:
  """-> (the correction's params, {"dart": the frozen head's (params, buffers)})."""
  params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype),
                        nnx.to_pure_dict(nnx.state(drafter.correction_module())))
  dart_params, dart_buffers = dart.split(drafter.dart_head(), param_dtype)
  return params, {"dart": {"params": dart_params, "buffers": dart_buffers}}


def merge_correction(config: DartGruConfig, params: dict, dtype=None) -> CorrectionModule:
  """Nested dicts -> a ``CorrectionModule`` (works on tracers inside jit)."""
  dtype = dtype or jax.tree.leaves(params)[0].dtype
  abstract = nnx.eval_shape(lambda: CorrectionModule(config, rngs=nnx.Rngs(0),
                                                     precision=dtype))
  graphdef, abs_params = nnx.split(abstract)
  nnx.replace_by_pure_dict(abs_params, params)
  return nnx.merge(graphdef, abs_params)


def from_state(config: DartGruConfig, params: dict, buffers: dict) -> DartGruDrafter:
  frozen = buffers["dart"]
  return DartGruDrafter.from_modules(
      config, dart.merge(config.dart, frozen["params"], frozen["buffers"]),
      merge_correction(config, params))


def forward(settings, target_model, params, buffers, batch, key, step, compute):
  del step
  c = settings.head_config
  to_compute = lambda tree: jax.tree.map(lambda p: p.astype(compute), tree)
  frozen = buffers["dart"]
  head = dart.merge(c.dart, to_compute(frozen["params"]), frozen["buffers"], compute)
  return dart_gru_losses.forward(
      head, merge_correction(c, to_compute(params), compute), target_model, batch, key,
      num_anchors=settings.num_anchors, level_decay=settings.level_decay,
      attn_impl=settings.attn_impl)


def step_metrics(settings, step) -> dict:
  del settings, step
  return {}


def summarize(settings, stats) -> dict:
  return dart_gru_losses.summarize(stats, settings.level_decay)


def feature_spec(drafter: DartGruDrafter) -> FeatureSpec:
  """Those of its frozen DART head."""
  return dart.feature_spec(drafter.dart_head())


def export(drafter: DartGruDrafter, directory: str) -> None:
  dj.save_dart_gru(drafter, directory)
