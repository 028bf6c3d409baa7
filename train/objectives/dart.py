"""The DART head's objective (``head.kind=dart``): the per-level KL of
``train/losses.py``; exported with ``save_dart`` (the reference format)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dart_jax as dj
from dart_jax.draft.dart_head import Buffer, DartConfig, DartHead, DartHeadModule
from train import data as data_lib
from train import losses
from train.features import FeatureSpec

log = logging.getLogger(__name__)

KINDS = ("dart",)
EMBEDDED = "embedded"  # head.init_from: the head shipped for the embedded target
CONFIG_TYPE = DartConfig


def make(config, target, rows: data_lib.Rows) -> DartHead:
  """From ``head.init_from``, else fresh with the data's most frequent tokens as
  the draft vocabulary."""
  hc = config.head
  if hc.init_from:
    embedded = hc.init_from == EMBEDDED
    head = dj.load_dart(None if embedded else hc.init_from, target)
    log.info("continuing from the head in %s",
             "dart_jax's assets" if embedded else hc.init_from)
    return head
  vocab = target.config.vocab_size
  vd = hc.draft_vocab_size if 0 < hc.draft_vocab_size < vocab else vocab
  head = DartHead.init(target, draft_length=hc.draft_length, draft_vocab_size=vd,
                       seed=config.seed, double_norm=hc.double_norm)
  if vd < vocab:
    head = head.with_draft_vocab(data_lib.select_draft_vocab(rows, vocab, vd))
  return head


def step_options(config, head: DartHead) -> dict:
  del config, head
  return {}


def split(head: DartHead, param_dtype) -> tuple[dict, dict]:
  """A head -> (trainable params, buffers) as nested dicts; params in param_dtype."""
  _, params, buffers = nnx.split(head.module(), nnx.Param, Buffer)
  params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), nnx.to_pure_dict(params))
  return params, nnx.to_pure_dict(buffers)


def merge(config: DartConfig, params: dict, buffers: dict, dtype=None) -> DartHeadModule:
  """Nested dicts -> a ``DartHeadModule`` (works on tracers inside jit)."""
  dtype = dtype or jax.tree.leaves(params)[0].dtype
  abstract = nnx.eval_shape(lambda: DartHeadModule(config, rngs=nnx.Rngs(0), precision=dtype))
  graphdef, abs_params, abs_buffers = nnx.split(abstract, nnx.Param, Buffer)
  nnx.replace_by_pure_dict(abs_params, params)
  nnx.replace_by_pure_dict(abs_buffers, buffers)
  return nnx.merge(graphdef, abs_params, abs_buffers)


def from_state(config: DartConfig, params: dict, buffers: dict) -> DartHead:
  graphdef, full = nnx.split(merge(config, params, buffers))
  return DartHead(config, graphdef, full)


def forward(settings, target_model, params, buffers, batch, key, step, compute):
  del step
  c = settings.head_config
  valid = losses.level_targets(batch["loss_mask"], batch["segment_ids"], c.num_levels)
  anchors, weights = losses.choose_anchors(key, valid, settings.num_anchors)
  taps, teacher, next_embeds = losses.target_features(
      target_model, batch, anchors, c.tap_layers, c.num_levels, buffers["d2t"],
      attn_impl=settings.attn_impl)
  head = merge(c, jax.tree.map(lambda p: p.astype(compute), params), buffers, compute)
  draft = losses.draft_logits(head, next_embeds, taps, batch["positions"],
                              batch["segment_ids"], anchors, attn_impl=settings.attn_impl)
  return losses.dart_loss(draft, teacher, weights, buffers["d2t"], settings.level_decay)


def step_metrics(settings, step) -> dict:
  del settings, step
  return {}


def summarize(settings, stats) -> dict:
  return losses.summarize(stats, settings.level_decay)


def feature_spec(head: DartHead) -> FeatureSpec:
  """Its taps and its teacher over the draft vocabulary."""
  return FeatureSpec(head.config.tap_layers, np.asarray(head.params["d2t"][...]))


def export(head: DartHead, directory: str) -> None:
  dj.save_dart(head, directory)
