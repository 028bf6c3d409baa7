"""Device mesh and parameter / batch shardings for training.

Mesh axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism with
parameters and optimizer state sharded along it) and ``tensor`` (the hidden /
head / vocabulary dimension of matrices). The batch is sharded over
``("data", "fsdp")``. Parameters are sharded by the rules on their path that
inference uses too (``dart_jax.sharding.PARAM_RULES``); a dimension is only
sharded when the mesh axis divides it, otherwise it is replicated (tiny models
and odd vocabulary sizes stay correct).
"""

import logging
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dart_jax.errors import ConfigError
from dart_jax.sharding import DATA, FSDP, TENSOR, resolve_sizes

log = logging.getLogger(__name__)

AXES = (DATA, FSDP, TENSOR)
BATCH_AXES = (DATA, FSDP)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh; one axis may be -1 (the remaining devices)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_sizes((data, fsdp, tensor), len(devices), "mesh (data, fsdp, tensor)")
  if int(np.prod(shape)) != len(devices):
    raise ConfigError(f"mesh (data, fsdp, tensor) = {tuple(shape)} needs "
                      f"{int(np.prod(shape))} devices, {len(devices)} are available")
  return jax.make_mesh(tuple(shape), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Rows over (data, fsdp); the sequence dimension replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over (data, fsdp)."""
  sharding = batch_sharding(mesh)
  out = {}
  for name, value in local.items():
    shape = (value.shape[0] * jax.process_count(),) + value.shape[1:]
    out[name] = jax.make_array_from_process_local_data(sharding, value, shape)
  return out
