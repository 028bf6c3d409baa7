"""NNX state <-> named checkpoint tensors, shared by the target and the drafters.

Checkpoints name tensors the PyTorch way (``model.layers.0.mlp.up_proj.weight``)
and store linear weights as [out, in]; NNX kernels are [in, out]. Every leaf
whose NNX name ends in ``kernel`` has its last two axes swapped on the way in and
out (stacked expert kernels are [E, in, out]); a ``weight`` leaf (the fast modes'
layout, ``layers.Dense``) is [..., out, in] already; a ``panels`` leaf (the
``fast`` mode on CPUs where the kernel's panel form runs) is
``kernels.cpu_matmul.to_panels`` of [out, in].
"""

import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.errors import CheckpointError
from kernels import cpu_matmul

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


def _is_panels(path: str) -> bool:
  return path.rsplit("/", 1)[-1] == "panels"


def _panels_shape(shape: tuple) -> tuple:
  """[..., out, in] -> the shape ``to_panels`` gives it (out % 8 == 0 is checked)."""
  *lead, out, k = shape
  if out % cpu_matmul.PANEL:
    return tuple(shape)  # cannot match a panels leaf; the shape check reports it
  return (*lead, out // cpu_matmul.PANEL, k, cpu_matmul.PANEL)


def _flip(array: np.ndarray) -> np.ndarray:
  """[..., a, b] -> [..., b, a] (a plain transpose for matrices)."""
  return np.swapaxes(array, -1, -2) if array.ndim >= 2 else array


def _sliced(tensor, index: tuple, flip: bool, dtype) -> np.ndarray:
  """``tensor`` (stored layout) read at ``index`` of its model layout."""
  if flip and len(index) >= 2:
    index = index[:-2] + (index[-1], index[-2])
    return np.asarray(_flip(np.asarray(tensor[index])), dtype=dtype)
  return np.asarray(tensor[index], dtype=dtype)


def state_from_tensors(make_module: Callable[[], nnx.Module],
                       tensors: Mapping[str, np.ndarray], name_of: Callable[[str], str],
                       *, source: str, what: str,
                       sharding_of: Callable[[str, tuple], Any] | None = None):
  """Builds (graphdef, state) of ``make_module()`` from checkpoint tensors.

  The module is only traced (``nnx.eval_shape``), never initialised. Leaves keep
  the dtype the module declares. With ``sharding_of(path, shape) ->
  NamedSharding`` each leaf is built shard by shard from slices of its tensor
  (numpy arrays or ``dart_jax.io.LazyTensor``), so no device receives a whole
  tensor it does not keep. Raises CheckpointError naming ``source`` for missing
  tensors and shape mismatches; ``what`` describes the expected model.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
  leaves, missing = [], []
  for path, var in nnx.to_flat_state(abstract):
    key = state_path(path)
    name = name_of(key)
    if name not in tensors:
      missing.append(name)
      continue
    tensor = tensors[name]
    if sharding_of is None:
      tensor = np.asarray(tensor)
    flip = _is_kernel(key) and len(tensor.shape) >= 2
    panels = _is_panels(key) and len(tensor.shape) >= 2
    shape = tuple(tensor.shape[:-2]) + tuple(tensor.shape[-2:][::-1]) if flip else tuple(
        tensor.shape)
    if panels:
      shape = _panels_shape(shape)
    if shape != tuple(var.shape):
      want = tuple(var.shape)
      if _is_kernel(key):
        want = want[:-2] + want[-2:][::-1]
      if _is_panels(key):
        want = tuple(cpu_matmul.from_panels(np.zeros(want, np.int8)).shape)
      raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, but "
                            f"the config expects {want}; config.json and the weights "
                            "disagree")
    if panels:  # packed whole: only single-device targets use panels
      value = jnp.asarray(np.ascontiguousarray(cpu_matmul.to_panels(np.asarray(tensor))),
                          dtype=var.dtype)
      if sharding_of is not None:
        value = jax.device_put(value, sharding_of(key, shape))
    elif sharding_of is None:
      value = jnp.asarray(_flip(tensor) if flip else tensor, dtype=var.dtype)
    else:
      value = jax.make_array_from_callback(
          shape, sharding_of(key, shape),
          lambda index, t=tensor, f=flip, d=var.dtype: _sliced(t, index, f, d))
    leaves.append((path, var.replace(value)))
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
    if _is_panels(key):
      array = cpu_matmul.from_panels(array)
    out[name_of(key)] = np.ascontiguousarray(_flip(array) if _is_kernel(key) else array)
  return out
