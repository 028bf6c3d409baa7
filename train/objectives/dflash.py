"""The DFlash / Domino drafter's objective (``head.kind=dflash|domino``): the
block objective of ``train/dflash_losses.py``; exported with ``save_dflash`` in
the released format."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

import dart_jax as dj
from dart_jax.draft.dflash import (PROJECTOR_DOMINO, DFlashConfig, DFlashDrafter, DFlashModule,
                                   default_target_layer_ids)
from dart_jax.errors import ConfigError
from train import dflash_losses
from train.configs import REQUIRED
from train.features import FeatureSpec

log = logging.getLogger(__name__)

KINDS = ("dflash", "domino")
CONFIG_TYPE = DFlashConfig


def make(config, target, rows=None) -> DFlashDrafter:
  """The drafter to train: from ``dflash.init_from`` (a DFlash backbone gets a
  fresh Domino head for ``head.kind=domino``) or fresh."""
  del rows
  dc, domino = config.dflash, config.head.kind == "domino"
  if dc.init_from == REQUIRED:
    raise ConfigError("this preset continues a trained drafter: set "
                      "dflash.init_from=/path/to/drafter (e.g. runs/domino_v2/best)")
  if dc.init_from:
    drafter = dj.load_dflash(dc.init_from, target)
    if drafter.domino and not domino:
      raise ConfigError(f"dflash.init_from={dc.init_from!r} holds a Domino drafter; "
                        "train it with head.kind=domino")
    log.info("continuing from the drafter in %s (its config.json fixes the architecture)",
             dc.init_from)
    if domino and not drafter.domino:
      # A fresh Domino head on the loaded DFlash backbone.
      with_head = dataclasses.replace(drafter.config, projector_type=PROJECTOR_DOMINO,
                                      emb_dim=dc.emb_dim, gru_hidden_dim=dc.gru_hidden_dim)
      graphdef, params = nnx.split(DFlashModule(with_head, rngs=nnx.Rngs(config.seed),
                                                precision=target.precision.for_drafter()))
      pure = nnx.to_pure_dict(params)
      pure.update(nnx.to_pure_dict(drafter.params))  # the backbone's entries
      nnx.replace_by_pure_dict(params, pure)
      drafter = DFlashDrafter(with_head, graphdef, params)
    return drafter
  tc = target.config
  if dc.mask_token_id >= tc.vocab_size:
    raise ConfigError(f"dflash.mask_token_id={dc.mask_token_id} is outside the target's "
                      f"vocabulary [0, {tc.vocab_size}); -1 picks the last id")
  ids = dc.target_layer_ids or None
  if ids is not None and max(ids) >= tc.num_layers:
    raise ConfigError(f"dflash.target_layer_ids={list(ids)} out of range for a target "
                      f"with {tc.num_layers} layers")
  if ids is None and dc.num_taps:
    ids = default_target_layer_ids(tc.num_layers, dc.num_taps)
  return DFlashDrafter.init(
      target, block_size=dc.block_size, num_layers=dc.num_layers, domino=domino,
      seed=config.seed, emb_dim=dc.emb_dim, gru_hidden_dim=dc.gru_hidden_dim,
      intermediate_size=dc.intermediate_size or None, target_layer_ids=ids,
      mask_token_id=None if dc.mask_token_id < 0 else dc.mask_token_id)


def step_options(config, drafter: DFlashDrafter) -> dict:
  """Slot weights' gamma, Domino's annealing length and base-loss floor."""
  return {"position_gamma": dflash_losses.resolve_gamma(config.loss.position_gamma,
                                                        drafter.config.block_size),
          "anneal_steps": int(round(config.loss.domino_anneal * config.steps)),
          "domino_floor": config.loss.domino_floor}


def split(drafter: DFlashDrafter, param_dtype) -> tuple[dict, dict]:
  """A drafter -> (trainable params, no buffers) as nested dicts."""
  params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype),
                        nnx.to_pure_dict(drafter.params))
  return params, {}


def merge(config: DFlashConfig, params: dict, dtype=None) -> DFlashModule:
  """Nested dicts -> a ``DFlashModule`` (works on tracers inside jit)."""
  dtype = dtype or jax.tree.leaves(params)[0].dtype
  abstract = nnx.eval_shape(lambda: DFlashModule(config, rngs=nnx.Rngs(0), precision=dtype))
  graphdef, abs_params = nnx.split(abstract)
  nnx.replace_by_pure_dict(abs_params, params)
  return nnx.merge(graphdef, abs_params)


def from_state(config: DFlashConfig, params: dict, buffers: dict) -> DFlashDrafter:
  del buffers
  graphdef, full = nnx.split(merge(config, params))
  return DFlashDrafter(config, graphdef, full)


def position_weights(settings):
  """Slot weights [D] of the settings' drafter."""
  return dflash_losses.position_weights(settings.head_config.num_depths,
                                        settings.position_gamma)


def forward(settings, target_model, params, buffers, batch, key, step, compute):
  del buffers
  drafter = merge(settings.head_config, jax.tree.map(lambda p: p.astype(compute), params),
                  compute)
  return dflash_losses.forward(
      drafter, target_model, batch, key, num_anchors=settings.num_anchors,
      weights=jnp.asarray(position_weights(settings)),
      lam=_domino_lambda(settings, step),
      attn_impl=settings.attn_impl)


def step_metrics(settings, step) -> dict:
  if not settings.head_config.domino:
    return {}
  return {"domino_lambda": _domino_lambda(settings, step)}


def _domino_lambda(settings, step) -> jax.Array:
  """Domino's base-loss weight at ``step`` (annealed, floored)."""
  return dflash_losses.domino_lambda(step, settings.anneal_steps, settings.domino_floor)


def summarize(settings, stats) -> dict:
  return dflash_losses.summarize(stats, position_weights(settings),
                                 settings.head_config.domino)


def feature_spec(drafter: DFlashDrafter) -> FeatureSpec:
  """Its context taps only: the labels are the data's tokens."""
  return FeatureSpec(tuple(drafter.config.taps), None)


def export(drafter: DFlashDrafter, directory: str) -> None:
  dj.save_dflash(drafter, directory)  # the released DFlash / Domino format
