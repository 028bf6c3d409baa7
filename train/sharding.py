"""Device mesh and parameter / batch shardings for training.

Mesh axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism with
parameters and optimizer state sharded along it) and ``tensor`` (the hidden /
head / vocabulary dimension of matrices). The batch is sharded over
``("data", "fsdp")``. Parameters are sharded by rules on their path; a
dimension is only sharded when the mesh axis divides it, otherwise it is
replicated (tiny models and odd vocabulary sizes stay correct).
"""

import logging
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dart_jax.errors import ConfigError

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (regex on the "/"-joined parameter path, partition of each dimension). Linear
# kernels are [in, out], dense weights (the fast modes' layout) [out, in]; the
# embedding is [V, H]. MoE experts are stacked [E, ...] (experts replicated; each
# expert's matrix split as a dense one) and come first, as the dense rules would
# also match their paths.
PARAM_RULES: tuple[tuple[str, tuple], ...] = (
    (r".*experts/(gate_proj|up_proj)/kernel", (None, "fsdp", "tensor")),
    (r".*experts/down_proj/kernel", (None, "tensor", "fsdp")),
    (r".*experts/(gate_proj|up_proj)/weight", (None, "tensor", "fsdp")),
    (r".*experts/down_proj/weight", (None, "fsdp", "tensor")),
    (r"(.*/)?embed_tokens/embedding", ("tensor", "fsdp")),
    (r".*(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel", ("fsdp", "tensor")),
    (r".*(o_proj|down_proj)/kernel", ("tensor", "fsdp")),
    (r"(.*/)?(lm_head|fc)/kernel", ("fsdp", "tensor")),
    (r".*(q_proj|k_proj|v_proj|gate_proj|up_proj)/weight", ("tensor", "fsdp")),
    (r".*(o_proj|down_proj)/weight", ("fsdp", "tensor")),
    (r"(.*/)?(lm_head|fc)/weight", ("tensor", "fsdp")),
    (r".*/bias", ("tensor",)),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh; one axis may be -1 (the remaining devices)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [data, fsdp, tensor]
  if shape.count(-1) > 1:
    raise ConfigError(f"at most one mesh axis may be -1, got {shape}")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ConfigError(f"mesh {shape}: {len(devices)} devices are not divisible by {known}")
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ConfigError(f"mesh (data, fsdp, tensor) = {tuple(shape)} needs "
                      f"{int(np.prod(shape))} devices, {len(devices)} are available")
  return jax.make_mesh(tuple(shape), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def spec_for(path: str, shape: Sequence[int], mesh: jax.sharding.Mesh) -> P:
  """The PartitionSpec of a parameter by ``PARAM_RULES`` (replicated if none)."""
  for pattern, axes in PARAM_RULES:
    if re.fullmatch(pattern, path):
      if len(axes) != len(shape):
        break
      parts = []
      for dim, axis in zip(shape, axes):
        size = mesh.shape[axis] if axis else 1
        parts.append(axis if axis and size > 1 and dim % size == 0 else None)
      return P(*parts)
  return P()


def path_str(path) -> str:
  """A pytree key path as ``a/b/c`` (the form ``PARAM_RULES`` match)."""
  parts = []
  for key in path:
    name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
    parts.append(str(name))
  path = "/".join(parts).replace(".", "/")
  return path[:-len("/value")] if path.endswith("/value") else path  # nnx.Variable leaf


def param_shardings(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """NamedShardings for every leaf of a parameter pytree (nnx.State or dict)."""
  def one(path, leaf):
    return NamedSharding(mesh, spec_for(path_str(path), np.shape(leaf), mesh))
  return jax.tree_util.tree_map_with_path(one, tree)


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


def maybe_initialize_distributed(mode: str = "auto") -> bool:
  """Calls ``jax.distributed.initialize()`` on multi-host runs.

  "auto": when the environment names several hosts (a coordinator address,
  ``TPU_WORKER_HOSTNAMES`` with several entries, SLURM / Open MPI with several
  tasks) errors propagate; otherwise it still tries, because Cloud TPU pod VMs
  are detected by JAX itself, and treats the ValueError that a single host
  raises as "single host". "on" always initialises, "off" never. Must run
  before any other JAX call. Returns whether it initialised.
  """
  if mode == "off":
    return False
  env = os.environ
  multi = (
      "," in env.get("TPU_WORKER_HOSTNAMES", "")
      or bool(env.get("JAX_COORDINATOR_ADDRESS"))
      or int(env.get("SLURM_NTASKS", "1") or 1) > 1
      or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
  )
  if mode == "on" or multi:
    jax.distributed.initialize()
    return True
  try:
    jax.distributed.initialize()
  except ValueError:  # One host: nothing to coordinate.
    return False
  except RuntimeError as e:
    # JAX is already running in this process (a notebook, a test, a second call):
    # too late to initialise, and nothing says there are other hosts.
    log.info("not initialising jax.distributed: %s", e)
    return False
  return True
