"""Frozen-target features computed once per training row (``data.target_features=cached``).

A DART step reads three things from the frozen target for each packed row: the
taps the head attends to, and at every position the target's next-token
distribution over the draft vocabulary (the KL teacher) and its argmax over the
full vocabulary (the accuracy metric). They never change during training, yet
the target's forward pass is nearly all of a step's cost (on a 2-core CPU,
SmolLM2-135M over 4 x 512 tokens: about 11 s of a 12 s step). Computing them
once turns every later epoch into a head-only pass, as EAGLE-style trainers do
with offline hidden states. A DFlash / Domino drafter reads only the outputs of
its target layers (its labels are the data's tokens), so its features are the
taps alone (``FeatureSpec.d2t`` None).

Stored under a features directory (``data.features_dir``, by default
``WORKDIR/features``), one folder per setting (the target, the tap layers, the
draft vocabulary, the dtype and the teacher size: ``settings_key``) and in it
one folder per *part*, a set of rows computed together:

  <settings>/<part>/row_keys.npy      [R] 16-byte digests of each row's tokens,
                                      segment ids and positions
  <settings>/<part>/taps.npy          [R, T, n*Ht]  float16 | float32
  <settings>/<part>/teacher_logp.npy  [R, T, Vd]    float16 | float32  log-softmax
                                      over draft ids
  <settings>/<part>/teacher_argmax.npy [R, T]       int32
  <settings>/<part>/progress.json     {"rows_done": r}: rows [0, r) are final

A row is found by its content, so a run computes only the rows that no
complete part holds yet: growing the data, or training on another selection of
files already seen by a run sharing the directory, reuses every unchanged row
(after a file boundary that moved, next-fit packing makes other rows until it
realigns; those are built). Several runs may read one directory; only one at
a time should build in it.

With ``teacher_topk=K`` (``data.teacher_topk``) the teacher is compact: only
each position's K most likely draft ids and their log-probabilities are kept
(``teacher_ids [R, T, K]`` int32, ``teacher_topk_logp [R, T, K]``) instead of
all Vd; ``FeatureStore.take`` rebuilds a dense teacher whose other Vd - K ids
share the remaining mass evenly. At Vd = 8192 and K = 64 that is 1/64 of the
teacher's bytes, what lets millions of tokens fit on a disk; the KL then
matches the target exactly on the top K and in total tail mass.

Rows are written in order and ``progress.json`` is replaced only after the
arrays are flushed, so an interrupted build resumes at the first unfinished
batch of its part. A folder from before parts existed (the features of one
run's rows directly under ``features_dir``) becomes a part when a run with
those rows finds it. Storing log-probabilities rather than logits keeps float16
precise where the mass is (the top tokens sit near 0).
"""

import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.errors import ConfigError
from train import losses
from train.data import Rows, pad_batch

log = logging.getLogger(__name__)

_VERSION = 1
_FLOAT16_MAX = float(np.finfo(np.float16).max)


class FeatureSpec(NamedTuple):
  """What a drafter's training reads from the frozen target per row."""

  tap_layers: tuple[int, ...]  # the target taps (``Target.forward(taps=...)``)
  d2t: np.ndarray | None  # [Vd] the teacher's draft vocabulary; None: taps only


@dataclasses.dataclass(frozen=True)
class FeatureStore:
  """The features of every training row, memory-mapped from one or more parts.

  Row r lives in ``parts[part[r]]`` at row ``offset[r]``.
  """

  directories: tuple[str, ...]  # the part folders
  parts: tuple[dict[str, np.ndarray], ...]  # per part: field -> [R_part, ...]
  part: np.ndarray  # [R] int32
  offset: np.ndarray  # [R] int64
  draft_vocab_size: int = 0  # Vd, to rebuild a compact teacher (0: stored dense)

  def __len__(self) -> int:
    return len(self.part)

  def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``index`` as a dict to merge into a ``Rows.take`` batch: taps,
    teacher_logp [n, T, Vd] (rebuilt when stored compact) and teacher_argmax."""
    index = np.asarray(index)
    out = {name: np.empty((len(index),) + array.shape[1:], array.dtype)
           for name, array in self.parts[0].items()}
    for p in np.unique(self.part[index]):
      where = np.nonzero(self.part[index] == p)[0]
      for name, array in self.parts[p].items():
        out[name][where] = array[self.offset[index[where]]]
    if "teacher_ids" in out:
      out["teacher_logp"] = dense_teacher(out.pop("teacher_ids"),
                                          out.pop("teacher_topk_logp"),
                                          self.draft_vocab_size)
    return out


def dense_teacher(ids: np.ndarray, topk_logp: np.ndarray, vocab: int) -> np.ndarray:
  """A compact teacher as log-probabilities over all ``vocab`` draft ids.

  ids / topk_logp: [..., K] the K most likely draft ids and their log-probs.
  The other ids share the remaining mass evenly (float32 [..., vocab]).
  """
  topk_logp = topk_logp.astype(np.float32)
  k = ids.shape[-1]
  rest = np.clip(1.0 - np.exp(topk_logp).sum(-1, keepdims=True), 1e-30, 1.0)
  fill = np.log(rest / max(vocab - k, 1)) if vocab > k else np.full_like(rest, -1e30)
  dense = np.broadcast_to(fill, ids.shape[:-1] + (vocab,)).copy()
  np.put_along_axis(dense, ids.astype(np.int64), topk_logp, axis=-1)
  return np.maximum(dense, -_FLOAT16_MAX)


def _settings_json(target, tap_layers, dtype: str, teacher_topk: int) -> bytes:
  return json.dumps({
      "target": target.source, "config": repr(target.config),
      "target_precision": target.precision.name, "taps": list(tap_layers),
      "dtype": dtype, "version": _VERSION,
      **({"teacher_topk": teacher_topk} if teacher_topk else {})}, sort_keys=True).encode()


def settings_key(target, tap_layers, d2t: np.ndarray | None, dtype: str,
                 teacher_topk: int = 0) -> str:
  """A digest of everything the features depend on besides the rows (``d2t``
  None: taps only, no teacher)."""
  digest = hashlib.sha256()
  digest.update(b"taps only" if d2t is None
                else np.ascontiguousarray(np.asarray(d2t, np.int64)).tobytes())
  digest.update(_settings_json(target, tap_layers, dtype, teacher_topk))
  return digest.hexdigest()[:16]


def row_keys(rows: Rows) -> np.ndarray:
  """[R] 16-byte digests of each row's tokens, segment ids and positions."""
  keys = np.empty(len(rows), "S16")
  for r in range(len(rows)):
    digest = hashlib.sha256()
    for array in (rows.tokens, rows.segment_ids, rows.positions):
      digest.update(np.ascontiguousarray(array[r], np.int32).tobytes())
    keys[r] = digest.digest()[:16]
  return keys


def _part_key(keys: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(keys).tobytes()).hexdigest()[:16]


def _legacy_key(target, rows: Rows, tap_layers, d2t: np.ndarray, dtype: str,
                teacher_topk: int) -> str:
  """The folder name features of exactly ``rows`` had before parts existed."""
  digest = hashlib.sha256()
  for array in (rows.tokens, rows.segment_ids, rows.positions):
    digest.update(np.ascontiguousarray(array).tobytes())
  digest.update(np.ascontiguousarray(np.asarray(d2t, np.int64)).tobytes())
  digest.update(_settings_json(target, tap_layers, dtype, teacher_topk))
  return digest.hexdigest()[:16]


@functools.partial(jax.jit, static_argnames=("graphdef", "tap_layers", "attn_impl",
                                             "teacher_topk"))
def row_features(graphdef, params, batch: dict, d2t: jax.Array | None, *,
                 tap_layers: tuple[int, ...], attn_impl: str = "xla", teacher_topk: int = 0):
  """One frozen target pass over packed rows [B, T] -> (taps [B, T, n*Ht],
  Teacher at every position [B, T], and with ``teacher_topk`` K the top-K
  (log-probs [B, T, K], draft ids [B, T, K]) of its log-probs, else None).
  ``d2t`` None: taps only (no LM head), the other two None."""
  target_model = nnx.merge(graphdef, params)
  tokens = batch["tokens"]
  out = target_model(tokens, batch["positions"], None,
                     losses.target_attention_mask(batch["segment_ids"]), taps=tap_layers,
                     attn_impl=attn_impl,
                     **({"logit_rows": jnp.zeros((tokens.shape[0], 0), jnp.int32)}
                        if d2t is None else {}))
  if d2t is None:
    return out.taps, None, None
  teacher = losses.teacher_from_logits(out.logits, d2t)
  if not teacher_topk:
    return out.taps, teacher, None
  # Only the top K leave the device: the dense [B, T, Vd] teacher is not stored.
  return out.taps, teacher._replace(logp=None), jax.lax.top_k(teacher.logp, teacher_topk)


def _shapes(target, num_rows: int, length: int, tap_layers, vocab: int | None,
            teacher_topk: int = 0) -> dict[str, tuple[int, ...]]:
  shapes = {"taps": (num_rows, length, len(tap_layers) * target.config.hidden_size)}
  if vocab is None:
    return shapes
  shapes["teacher_argmax"] = (num_rows, length)
  if teacher_topk:
    shapes.update(teacher_ids=(num_rows, length, teacher_topk),
                  teacher_topk_logp=(num_rows, length, teacher_topk))
  else:
    shapes["teacher_logp"] = (num_rows, length, vocab)
  return shapes


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
  for name in shapes:
    path = os.path.join(directory, name + ".npy")
    field_dtype = (np.int32 if name in ("teacher_argmax", "teacher_ids")
                   else np.dtype(dtype))
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


def load_or_build(target, rows: Rows, tap_layers, d2t, features_dir: str, *,
                  dtype: str = "float16", batch_size: int = 4, attn_impl: str = "xla",
                  progress: bool = True, teacher_topk: int = 0,
                  batch_callback: Callable[[int], None] | None = None) -> FeatureStore:
  """The features of ``rows``: found by row in ``features_dir``, the rest built.

  Args:
    target: the frozen ``Target``.
    rows: the packed training rows.
    tap_layers: the drafter's target taps (``FeatureSpec.tap_layers``).
    d2t: [Vd] the head's draft-vocabulary offsets, for the teacher; None
      stores the taps only (DFlash / Domino: their labels are the data's tokens).
    features_dir: the features directory (``data.features_dir``; a run's default
      is ``WORKDIR/features``).
    dtype: "float16" or "float32" storage of taps and log-probs.
    batch_size: rows per target pass.
    attn_impl: the target's attention implementation.
    progress: show a progress bar.
    teacher_topk: K > 0 stores the compact teacher (the K most likely draft
      ids per position); 0 the dense one. K must be below Vd. Ignored without
      a teacher.
    batch_callback: called with the rows done in the part being built after each
      written batch (tests interrupt a build with it).
  Raises:
    ConfigError: float16 cannot hold the target's taps.
  """
  tap_layers = tuple(int(i) for i in tap_layers)
  if d2t is None:
    teacher_topk = 0
  else:
    d2t = np.asarray(d2t)
    if not 0 <= teacher_topk < len(d2t):
      raise ConfigError(f"data.teacher_topk={teacher_topk} must be in [0, {len(d2t)}) (the "
                        "draft vocabulary); 0 stores the whole teacher")
  root = os.path.join(features_dir, settings_key(target, tap_layers, d2t, dtype, teacher_topk))
  keys = row_keys(rows)
  if d2t is not None:
    _adopt_legacy(os.path.join(features_dir, _legacy_key(target, rows, tap_layers, d2t, dtype,
                                                         teacher_topk)),
                  os.path.join(root, _part_key(keys)), keys)
  found = _complete_parts(root)
  # Rows with the same content are computed once.
  unique_keys, first = np.unique(keys, return_index=True)
  missing = np.sort(first[[key not in found for key in unique_keys]])
  if len(missing):
    log.info("%d of %d rows have target features in %s; computing the other %d",
             len(rows) - np.isin(keys, keys[missing]).sum(), len(rows), root, len(missing))
    directory = os.path.join(root, _part_key(keys[missing]))
    arrays = _build_part(directory, target, Rows(**rows.take(missing)), keys[missing],
                         tap_layers, d2t, dtype=dtype, batch_size=batch_size,
                         attn_impl=attn_impl, progress=progress, teacher_topk=teacher_topk,
                         batch_callback=batch_callback)
    for i, key in enumerate(keys[missing]):
      found[key] = (directory, arrays, i)
  else:
    log.info("loaded target features of %d rows from %s", len(rows), root)
  directories = sorted({found[key][0] for key in keys})
  part_of = {d: p for p, d in enumerate(directories)}
  parts = [None] * len(directories)
  for key in keys:
    directory, arrays, _ = found[key]
    parts[part_of[directory]] = arrays
  return FeatureStore(tuple(directories), tuple(parts),
                      np.array([part_of[found[key][0]] for key in keys], np.int32),
                      np.array([found[key][2] for key in keys], np.int64),
                      len(d2t) if teacher_topk else 0)


def _adopt_legacy(legacy: str, part: str, keys: np.ndarray) -> None:
  """Turns the features of exactly these rows in the layout before parts (one
  folder named by rows and settings) into the part holding all of them."""
  if not os.path.isdir(legacy) or os.path.exists(part):
    return
  np.save(os.path.join(legacy, "row_keys.npy"), keys)
  os.makedirs(os.path.dirname(part), exist_ok=True)
  os.replace(legacy, part)
  log.info("moved the features in %s to %s", legacy, part)


def _complete_parts(root: str) -> dict[bytes, tuple[str, dict, int]]:
  """Row key -> (part folder, its arrays read-only, row in it) over the complete
  parts under ``root``; unreadable parts are skipped (and rebuilt if needed)."""
  found = {}
  if not os.path.isdir(root):
    return found
  for name in sorted(os.listdir(root)):
    directory = os.path.join(root, name)
    try:
      keys = np.load(os.path.join(directory, "row_keys.npy"))
      fields = [f[:-4] for f in os.listdir(directory)
                if f.endswith(".npy") and f != "row_keys.npy"]
      arrays = {f: np.load(os.path.join(directory, f + ".npy"), mmap_mode="r")
                for f in fields}
    except (OSError, ValueError):
      continue
    if (_read_progress(directory) < len(keys) or not arrays
        or any(len(a) != len(keys) for a in arrays.values())):
      continue
    arrays = {f: arrays[f] for f in sorted(arrays)}
    for i, key in enumerate(keys):
      found.setdefault(key, (directory, arrays, i))
  return found


def _build_part(directory: str, target, rows: Rows, keys: np.ndarray, tap_layers, d2t, *,
                dtype: str, batch_size: int, attn_impl: str, progress: bool,
                teacher_topk: int, batch_callback) -> dict[str, np.ndarray]:
  """Computes (or resumes) the features of ``rows`` into the part ``directory``."""
  os.makedirs(directory, exist_ok=True)
  shapes = _shapes(target, *rows.tokens.shape, tap_layers,
                   None if d2t is None else len(d2t), teacher_topk)
  done = _read_progress(directory)
  arrays = _open_arrays(directory, shapes, dtype, resume=done > 0)
  if arrays is None:
    log.warning("the features in %s are incomplete or damaged; rebuilding them", directory)
    done = 0
    arrays = _open_arrays(directory, shapes, dtype, resume=False)
  if done == 0:
    np.save(os.path.join(directory, "row_keys.npy"), keys)
  num_rows = len(rows)

  from tqdm import tqdm
  log.info("computing target features of rows %d..%d into %s", done, num_rows, directory)
  device_d2t = None if d2t is None else jnp.asarray(d2t)
  with tqdm(total=num_rows, initial=done, unit="row", desc="target features",
            dynamic_ncols=True, disable=not progress) as bar:
    for start in range(done, num_rows, batch_size):
      index = np.arange(start, min(start + batch_size, num_rows))
      batch = pad_batch(rows.take(index), batch_size)
      taps, teacher, top = jax.device_get(row_features(
          target.graphdef, target.params, batch, device_d2t, tap_layers=tap_layers,
          attn_impl=attn_impl, teacher_topk=teacher_topk))
      n = len(index)
      _check_range(taps[:n], dtype)
      arrays["taps"][start:start + n] = taps[:n]
      if teacher is not None:
        _write_teacher(arrays, slice(start, start + n), teacher, top)
      for array in arrays.values():
        array.flush()
      _write_progress(directory, start + n)
      bar.update(n)
      if batch_callback is not None:
        batch_callback(start + n)
  return {name: arrays[name] for name in sorted(arrays)}


def _write_teacher(arrays: dict, rows: slice, teacher, top) -> None:
  """Stores a batch's teacher (``row_features``' outputs) in ``arrays[rows]``."""
  n = rows.stop - rows.start
  # float16 turns log-probs below -65504 into -inf, and 0 * inf is NaN in the KL.
  if top is not None:
    top_logp, top_ids = top
    arrays["teacher_ids"][rows] = top_ids[:n]
    arrays["teacher_topk_logp"][rows] = np.maximum(top_logp[:n], -_FLOAT16_MAX)
  else:
    arrays["teacher_logp"][rows] = np.maximum(teacher.logp[:n], -_FLOAT16_MAX)
  arrays["teacher_argmax"][rows] = teacher.argmax[:n]


def _check_range(taps: np.ndarray, dtype: str) -> None:
  if dtype == "float16" and np.abs(taps).max(initial=0.0) > _FLOAT16_MAX:
    raise ConfigError("the target's taps exceed the float16 range; set "
                      "data.features_dtype=float32")

