"""Frozen-target features computed once per training row (``data.target_features=cached``).

A DART step reads three things from the frozen target for each packed row: the
taps the head attends to, and at every position the target's next-token
distribution over the draft vocabulary (the KL teacher) and its argmax over the
full vocabulary (the accuracy metric). They never change during training, yet
the target's forward pass is nearly all of a step's cost (on a 2-core CPU,
SmolLM2-135M over 4 x 512 tokens: about 11 s of a 12 s step). Computing them
once turns every later epoch into a head-only pass, as EAGLE-style trainers do
with offline hidden states.

Stored per training set under ``WORKDIR/features/<key>/`` (the key hashes the
rows, the target, the tap layers, the draft vocabulary and the dtype, so a
changed input never reuses stale features):

  taps.npy            [R, T, n*Ht]  float16 | float32
  teacher_logp.npy    [R, T, Vd]    float16 | float32  log-softmax over draft ids
  teacher_argmax.npy  [R, T]        int32
  progress.json       {"rows_done": r}: rows [0, r) are final

Rows are written in order and ``progress.json`` is replaced only after the
arrays are flushed, so an interrupted build resumes at the first unfinished
batch. Storing log-probabilities rather than logits keeps float16 precise where
the mass is (the top tokens sit near 0).
"""

import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.errors import ConfigError
from train import losses
from train.data import Rows, pad_batch

log = logging.getLogger(__name__)

FIELDS = ("taps", "teacher_logp", "teacher_argmax")
_VERSION = 1
_FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclasses.dataclass(frozen=True)
class FeatureStore:
  """The features of every training row, memory-mapped from ``directory``."""

  directory: str
  arrays: dict[str, np.ndarray]

  def __len__(self) -> int:
    return self.arrays["taps"].shape[0]

  def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``index`` of every field: a dict to merge into a ``Rows.take`` batch."""
    return {name: np.asarray(array[index]) for name, array in self.arrays.items()}


def features_key(target, rows: Rows, tap_layers, d2t: np.ndarray, dtype: str) -> str:
  """A digest of everything the features depend on."""
  digest = hashlib.sha256()
  for array in (rows.tokens, rows.segment_ids, rows.positions):
    digest.update(np.ascontiguousarray(array).tobytes())
  digest.update(np.ascontiguousarray(np.asarray(d2t, np.int64)).tobytes())
  digest.update(json.dumps({
      "target": target.source, "config": repr(target.config),
      "target_precision": target.precision.name, "taps": list(tap_layers),
      "dtype": dtype, "version": _VERSION}, sort_keys=True).encode())
  return digest.hexdigest()[:16]


@functools.partial(jax.jit, static_argnames=("graphdef", "tap_layers", "attn_impl"))
def row_features(graphdef, params, batch: dict, d2t: jax.Array, *, tap_layers: tuple[int, ...],
                 attn_impl: str = "xla") -> tuple[jax.Array, losses.Teacher]:
  """One frozen target pass over packed rows [B, T] -> (taps [B, T, n*Ht],
  Teacher at every position [B, T])."""
  target_model = nnx.merge(graphdef, params)
  out = target_model(batch["tokens"], batch["positions"], None,
                     losses.target_attention_mask(batch["segment_ids"]), taps=tap_layers,
                     attn_impl=attn_impl)
  return out.taps, losses.teacher_from_logits(out.logits, d2t)


def _shapes(target, rows: Rows, tap_layers, vocab: int) -> dict[str, tuple[int, ...]]:
  num_rows, length = rows.tokens.shape
  return {"taps": (num_rows, length, len(tap_layers) * target.config.hidden_size),
          "teacher_logp": (num_rows, length, vocab),
          "teacher_argmax": (num_rows, length)}


def _read_progress(directory: str) -> int:
  try:
    with open(os.path.join(directory, "progress.json")) as f:
      return int(json.load(f)["rows_done"])
  except (OSError, ValueError, KeyError, TypeError):
    return 0


def _write_progress(directory: str, rows_done: int) -> None:
  path = os.path.join(directory, "progress.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"rows_done": rows_done}, f)
  os.replace(path + ".tmp", path)


def _open_arrays(directory: str, shapes: dict, dtype: str, resume: bool
                 ) -> dict[str, np.ndarray] | None:
  """Memory-maps the fields (creating them unless resuming); None if a file to
  resume from is missing or has another shape or dtype."""
  arrays = {}
  for name in FIELDS:
    path = os.path.join(directory, name + ".npy")
    field_dtype = np.int32 if name == "teacher_argmax" else np.dtype(dtype)
    if resume:
      try:
        # Read-only first: "r+" would silently extend a truncated file with zeros.
        np.load(path, mmap_mode="r")
        array = np.load(path, mmap_mode="r+")
      except (OSError, ValueError):
        return None
      if array.shape != shapes[name] or array.dtype != field_dtype:
        return None
    else:
      array = np.lib.format.open_memmap(path, mode="w+", dtype=field_dtype,
                                        shape=shapes[name])
    arrays[name] = array
  return arrays


def load_or_build(target, rows: Rows, tap_layers, d2t, workdir: str, *,
                  dtype: str = "float16", batch_size: int = 4, attn_impl: str = "xla",
                  progress: bool = True,
                  batch_callback: Callable[[int], None] | None = None) -> FeatureStore:
  """The features of ``rows``: loaded when complete, else built (or resumed).

  Args:
    target: the frozen ``Target``.
    rows: the packed training rows.
    tap_layers: the head's tap indices (``DartConfig.tap_layers``).
    d2t: [Vd] the head's draft-vocabulary offsets.
    workdir: the run's directory; features go to ``workdir/features/<key>``.
    dtype: "float16" or "float32" storage of taps and log-probs.
    batch_size: rows per target pass.
    attn_impl: the target's attention implementation.
    progress: show a progress bar.
    batch_callback: called with the rows done after each written batch (tests
      interrupt a build with it).
  Raises:
    ConfigError: float16 cannot hold the target's taps.
  """
  tap_layers = tuple(int(i) for i in tap_layers)
  d2t = np.asarray(d2t)
  directory = os.path.join(workdir, "features",
                           features_key(target, rows, tap_layers, d2t, dtype))
  os.makedirs(directory, exist_ok=True)
  shapes = _shapes(target, rows, tap_layers, len(d2t))
  done = _read_progress(directory)
  arrays = _open_arrays(directory, shapes, dtype, resume=done > 0)
  if arrays is None:
    log.warning("the features in %s are incomplete or damaged; rebuilding them", directory)
    done = 0
    arrays = _open_arrays(directory, shapes, dtype, resume=False)
  num_rows = len(rows)
  if done >= num_rows:
    log.info("loaded target features of %d rows from %s", num_rows, directory)
    return FeatureStore(directory, arrays)

  from tqdm import tqdm
  log.info("computing target features of rows %d..%d into %s", done, num_rows, directory)
  device_d2t = jnp.asarray(d2t)
  with tqdm(total=num_rows, initial=done, unit="row", desc="target features",
            dynamic_ncols=True, disable=not progress) as bar:
    for start in range(done, num_rows, batch_size):
      index = np.arange(start, min(start + batch_size, num_rows))
      batch = pad_batch(rows.take(index), batch_size)
      taps, teacher = jax.device_get(row_features(
          target.graphdef, target.params, batch, device_d2t, tap_layers=tap_layers,
          attn_impl=attn_impl))
      n = len(index)
      _check_range(taps[:n], dtype)
      arrays["taps"][start:start + n] = taps[:n]
      # float16 turns log-probs below -65504 into -inf, and 0 * inf is NaN in the KL.
      arrays["teacher_logp"][start:start + n] = np.maximum(teacher.logp[:n], -_FLOAT16_MAX)
      arrays["teacher_argmax"][start:start + n] = teacher.argmax[:n]
      for array in arrays.values():
        array.flush()
      _write_progress(directory, start + n)
      bar.update(n)
      if batch_callback is not None:
        batch_callback(start + n)
  return FeatureStore(directory, arrays)


def _check_range(taps: np.ndarray, dtype: str) -> None:
  if dtype == "float16" and np.abs(taps).max(initial=0.0) > _FLOAT16_MAX:
    raise ConfigError("the target's taps exceed the float16 range; set "
                      "data.features_dtype=float32")

