"""NNX state <-> named checkpoint tensors, shared by the target and the drafters.

Checkpoints name tensors the PyTorch way (``model.layers.0.mlp.up_proj.weight``)
and store linear weights as [out, in]; NNX kernels are [in, out]. Every leaf
whose NNX name ends in ``kernel`` has its last two axes swapped on the way in and
out (stacked expert kernels are [E, in, out]); a ``weight`` leaf (the fast modes'
layout, ``layers.Dense``) is [..., out, in] already.
"""

import re
from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.errors import CheckpointError

NameRules = Sequence[tuple[str, str]]


def state_path(path: tuple) -> str:
  """``('layers', 0, 'mlp', 'up_proj', 'kernel')`` -> ``layers/0/mlp/up_proj/kernel``."""
  return "/".join(str(p) for p in path)


def renamer(rules: NameRules) -> Callable[[str], str]:
  """A function mapping NNX state paths to checkpoint names by regex rules."""
  def name_of(path: str) -> str:
    for pattern, repl in rules:
      if re.fullmatch(pattern, path):
        return re.sub(pattern, repl, path)
    raise KeyError(f"no checkpoint name for parameter path {path!r}")
  return name_of


def _is_kernel(path: str) -> bool:
  return path.rsplit("/", 1)[-1].endswith("kernel")


def _flip(array: np.ndarray) -> np.ndarray:
  """[..., a, b] -> [..., b, a] (a plain transpose for matrices)."""
  return np.swapaxes(array, -1, -2) if array.ndim >= 2 else array


def state_from_tensors(make_module: Callable[[], nnx.Module],
                       tensors: Mapping[str, np.ndarray], name_of: Callable[[str], str],
                       *, source: str, what: str):
  """Builds (graphdef, state) of ``make_module()`` from checkpoint tensors.

  The module is only traced (``nnx.eval_shape``), never initialised. Leaves keep
  the dtype the module declares. Raises CheckpointError naming ``source`` for
  missing tensors and shape mismatches; ``what`` describes the expected model.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
  leaves, missing = [], []
  for path, var in nnx.to_flat_state(abstract):
    key = state_path(path)
    name = name_of(key)
    if name not in tensors:
      missing.append(name)
      continue
    array = np.asarray(tensors[name])
    if _is_kernel(key):
      array = _flip(array)
    if array.shape != tuple(var.shape):
      shown = _flip(array).shape if _is_kernel(key) else array.shape
      want = tuple(var.shape)
      if _is_kernel(key):
        want = want[:-2] + want[-2:][::-1]
      raise CheckpointError(f"{source}: tensor {name} has shape {shown}, but the config "
                            f"expects {want}; config.json and the weights disagree")
    leaves.append((path, var.replace(jnp.asarray(array, dtype=var.dtype))))
  if missing:
    raise CheckpointError(f"{source}: missing {len(missing)} tensor(s), e.g. "
                          f"{missing[:3]}; is this a {what} matching its config.json?")
  return graphdef, nnx.from_flat_state(leaves)


def tensors_from_state(state, name_of: Callable[[str], str]) -> dict[str, np.ndarray]:
  """Checkpoint tensors (numpy, [out, in] linear weights) of an NNX state."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    key = state_path(path)
    array = np.asarray(var[...])
    out[name_of(key)] = np.ascontiguousarray(_flip(array) if _is_kernel(key) else array)
  return out
