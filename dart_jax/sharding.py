"""Parameters, KV caches and batches on a device mesh (inference and training).

A mesh for inference has a ``"tensor"`` axis and optionally a ``"data"`` axis
(``jax.make_mesh((data, tensor), ("data", "tensor"))``, or ``parse_mesh``);
training adds ``"fsdp"``. Axes a rule names but the mesh lacks count as size 1,
and other mesh axes replicate.

Placement is Megatron-style: q/k/v/gate/up are column-parallel (their output
dimension over ``"tensor"``), o/down row-parallel (their input dimension), the
LM head and the embedding vocabulary-parallel, norms replicated. The shardings
only tell XLA where the arrays live; every jitted function computes the same
values as on one device (GSPMD inserts the collectives), so no model code
knows about the mesh. A dimension the axis does not divide stays replicated,
and attention stays replicated unless both the query and the key/value head
counts divide (a split through a head would move every head's slice around
each call); ``place_params`` logs what it replicated.

KV caches follow the attention: batch over ``"data"``, key/value heads over
``"tensor"`` (``cache_spec``); the prompt batch goes over ``"data"`` when the
axis divides it (``batch_sharding``).
"""

import dataclasses
import logging
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dart_jax.errors import ConfigError

log = logging.getLogger(__name__)

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"

# (regex on the "/"-joined parameter path, partition of each dimension, group).
# Linear kernels are [in, out], dense weights (the fast modes' layout) [out, in];
# the embedding is [V, H]. MoE experts are stacked [E, ...] (experts replicated;
# each expert's matrix split as a dense one) and come first, as the dense rules
# would also match their paths. Attention rules are the "attention" group, which
# ``place_params`` replicates when the head counts do not divide.
PARAM_RULES: tuple[tuple[str, tuple, str], ...] = (
    (r".*experts/(gate_proj|up_proj)/kernel", (None, FSDP, TENSOR), "mlp"),
    (r".*experts/down_proj/kernel", (None, TENSOR, FSDP), "mlp"),
    (r".*experts/(gate_proj|up_proj)/weight", (None, TENSOR, FSDP), "mlp"),
    (r".*experts/down_proj/weight", (None, FSDP, TENSOR), "mlp"),
    (r"(.*/)?embed_tokens/embedding", (TENSOR, FSDP), "vocab"),
    (r".*(q_proj|k_proj|v_proj)/kernel", (FSDP, TENSOR), "attention"),
    (r".*(gate_proj|up_proj)/kernel", (FSDP, TENSOR), "mlp"),
    (r".*o_proj/kernel", (TENSOR, FSDP), "attention"),
    (r".*down_proj/kernel", (TENSOR, FSDP), "mlp"),
    (r"(.*/)?(lm_head|fc)/kernel", (FSDP, TENSOR), "vocab"),
    (r".*(q_proj|k_proj|v_proj)/weight", (TENSOR, FSDP), "attention"),
    (r".*(gate_proj|up_proj)/weight", (TENSOR, FSDP), "mlp"),
    (r".*o_proj/weight", (FSDP, TENSOR), "attention"),
    (r".*down_proj/weight", (FSDP, TENSOR), "mlp"),
    (r"(.*/)?(lm_head|fc)/weight", (TENSOR, FSDP), "vocab"),
    (r".*(q_proj|k_proj|v_proj)/bias", (TENSOR,), "attention"),
    (r".*/bias", (TENSOR,), "mlp"),
)

# Drafters are small next to their target: only their LM head (the largest
# matrix, [H, Vd]) is split, over the vocabulary; the rest is replicated.
DRAFTER_RULES: tuple[tuple[str, tuple, str], ...] = (
    (r"(.*/)?lm_head/kernel", (None, TENSOR), "vocab"),
    (r"(.*/)?lm_head/weight", (TENSOR, None), "vocab"),
)

ALL_GROUPS = frozenset({"attention", "mlp", "vocab"})


def axis_size(mesh: jax.sharding.Mesh, axis: str | None) -> int:
  """The size of ``axis`` in ``mesh``; 1 for None or an axis the mesh lacks."""
  return int(mesh.shape[axis]) if axis and axis in mesh.shape else 1


def spec_for(path: str, shape: Sequence[int], mesh: jax.sharding.Mesh,
             rules=PARAM_RULES, groups: frozenset = ALL_GROUPS,
             replicated: list | None = None) -> P:
  """The PartitionSpec of a parameter by ``rules`` (replicated if none matches).

  groups: the rule groups allowed to split (others replicate).
  replicated: if given, collects ``"path[dim]"`` for each dimension a rule
    wanted split but the mesh axis does not divide.
  """
  for pattern, axes, group in rules:
    if not re.fullmatch(pattern, path):
      continue
    if len(axes) != len(shape):
      break
    parts = []
    for dim, (size, axis) in enumerate(zip(shape, axes)):
      n = axis_size(mesh, axis)
      split = n > 1 and size % n == 0 and group in groups
      if n > 1 and size % n and replicated is not None:
        replicated.append(f"{path}[{dim}]")
      parts.append(axis if split else None)
    return P(*parts)
  return P()


def path_str(path) -> str:
  """A pytree key path as ``a/b/c`` (the form the rules match)."""
  parts = []
  for key in path:
    name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
    parts.append(str(name))
  path = "/".join(parts).replace(".", "/")
  return path[:-len("/value")] if path.endswith("/value") else path  # nnx.Variable leaf


def param_shardings(tree: Any, mesh: jax.sharding.Mesh, rules=PARAM_RULES,
                    groups: frozenset = ALL_GROUPS, replicated: list | None = None) -> Any:
  """NamedShardings for every leaf of a parameter pytree (nnx.State or dict)."""
  def one(path, leaf):
    return NamedSharding(mesh, spec_for(path_str(path), np.shape(leaf), mesh, rules,
                                        groups, replicated))
  return jax.tree_util.tree_map_with_path(one, tree)


def attention_splits(num_heads: int, num_kv_heads: int, mesh: jax.sharding.Mesh) -> bool:
  """Whether attention is split over ``"tensor"``: both head counts divide."""
  n = axis_size(mesh, TENSOR)
  return n > 1 and num_heads % n == 0 and num_kv_heads % n == 0


def put(tree: Any, shardings: Any) -> Any:
  """Host or device values -> global arrays with ``shardings``.

  ``make_array_from_callback`` hands each device only its slice, which works
  when the mesh spans several hosts (each builds its own shards) and never puts
  a whole tensor on one device.
  """
  def one(x, s):
    if isinstance(x, jax.Array) and s.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


class Placement:
  """The sharding of each parameter of one model on a mesh, by path.

  ``placement(path, shape) -> NamedSharding``; ``report()`` logs what stayed
  replicated. num_heads / num_kv_heads: the model's attention head counts (0:
  attention follows the dimension rule alone).
  """

  def __init__(self, mesh: jax.sharding.Mesh, *, what: str, rules=PARAM_RULES,
               num_heads: int = 0, num_kv_heads: int = 0):
    mesh = auto_mesh(mesh)
    self.mesh, self.what, self.rules = mesh, what, rules
    self.groups = ALL_GROUPS
    self.replicated: list[str] = []
    if num_heads and not attention_splits(num_heads, num_kv_heads, mesh):
      self.groups = ALL_GROUPS - {"attention"}
      if axis_size(mesh, TENSOR) > 1:
        log.info("%s: %d query / %d key-value heads do not split %d ways over 'tensor'; "
                 "attention is replicated", what, num_heads, num_kv_heads,
                 axis_size(mesh, TENSOR))

  def __call__(self, path: str, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(self.mesh, spec_for(path, shape, self.mesh, self.rules,
                                             self.groups, self.replicated))

  def report(self) -> None:
    if self.replicated:
      log.info("%s: %d dimension(s) the mesh axis does not divide are replicated, e.g. %s",
               self.what, len(self.replicated), ", ".join(self.replicated[:3]))


def place_params(params: Any, mesh: jax.sharding.Mesh, *, what: str, rules=PARAM_RULES,
                 num_heads: int = 0, num_kv_heads: int = 0) -> Any:
  """``params`` sharded over ``mesh`` by ``rules`` (``Placement``); logs what
  stays replicated."""
  placement = Placement(mesh, what=what, rules=rules, num_heads=num_heads,
                        num_kv_heads=num_kv_heads)
  shardings = param_shardings(params, placement.mesh, rules, placement.groups,
                              placement.replicated)
  placement.report()
  return put(params, shardings)


def drafter_on_mesh(drafter: Any, target: Any) -> Any:
  """``drafter`` (a handle with ``params``) placed on ``target``'s mesh by
  ``DRAFTER_RULES`` (LM head vocabulary-parallel, the rest replicated); as it is
  when the target has no mesh."""
  mesh = getattr(target, "mesh", None)
  if mesh is None:
    return drafter
  params = place_params(drafter.params, mesh, what=type(drafter).__name__,
                        rules=DRAFTER_RULES)
  return dataclasses.replace(drafter, params=params)


def auto_mesh(mesh: Any) -> jax.sharding.Mesh:
  """``mesh`` checked, with every axis of type Auto.

  ``jax.make_mesh`` makes Explicit axes by default, under which every op on a
  sharded dimension must say how (a top-k over a vocabulary-parallel row is a
  type error); dart_jax places the arrays and leaves the collectives to XLA.
  Raises ConfigError unless ``mesh`` is a Mesh with a ``"tensor"`` axis.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ConfigError(f"mesh must be a jax.sharding.Mesh (jax.make_mesh((data, tensor), "
                      f"('data', 'tensor'))), got {type(mesh).__name__}")
  if TENSOR not in mesh.shape:
    raise ConfigError(f"the mesh has axes {tuple(mesh.axis_names)}; dart_jax shards models "
                      "over an axis named 'tensor' (and batches over 'data')")
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(mesh.axis_types) == auto:
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def resolve_sizes(sizes: Sequence[int], num_devices: int, what: str) -> tuple[int, ...]:
  """Mesh axis sizes with the one -1 (if any) set to the devices the others
  leave; raises ConfigError for sizes below 1 or a -1 that does not divide."""
  shape = list(sizes)
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f"{what}: sizes must be positive (at most one may be -1), got "
                      f"{tuple(shape)}")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if num_devices % known:
      raise ConfigError(f"{what}: {num_devices} devices are not divisible by {known}")
    shape[shape.index(-1)] = num_devices // known
  return tuple(shape)


def parse_mesh(text: str, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """``"data=2,tensor=4"`` -> a (data, tensor) mesh; one size may be -1 (the rest).

  Raises ConfigError for unknown axes, a malformed spec or a device count the
  sizes do not match.
  """
  sizes = {DATA: 1, TENSOR: 1}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, value = part.partition("=")
    if not eq or name.strip() not in sizes:
      raise ConfigError(f"mesh {text!r}: expected comma-separated data=N,tensor=M")
    try:
      sizes[name.strip()] = int(value)
    except ValueError:
      raise ConfigError(f"mesh {text!r}: {value!r} is not an integer") from None
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_sizes((sizes[DATA], sizes[TENSOR]), len(devices), f"mesh {text!r}")
  if int(np.prod(shape)) > len(devices):
    raise ConfigError(f"mesh {text!r} needs {int(np.prod(shape))} devices; "
                      f"{len(devices)} are available")
  used = devices[:int(np.prod(shape))]
  return jax.make_mesh(tuple(shape), (DATA, TENSOR), devices=used,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def batch_spec(mesh: jax.sharding.Mesh, batch: int, ndim: int) -> P:
  """Rows over ``"data"`` when it divides ``batch``, else replicated."""
  n = axis_size(mesh, DATA)
  lead = DATA if n > 1 and batch % n == 0 else None
  return P(lead, *([None] * (ndim - 1)))


def place_batch(x: Any, mesh: jax.sharding.Mesh | None) -> jax.Array:
  """A host array [B, ...] on ``mesh`` with its rows over ``"data"`` (or as is
  without a mesh)."""
  x = np.asarray(x)
  if mesh is None:
    return jax.numpy.asarray(x)
  return put(x, NamedSharding(mesh, batch_spec(mesh, x.shape[0], x.ndim)))


def cache_spec(mesh: jax.sharding.Mesh, shape: Sequence[int], head_axis: int,
               split_heads: bool) -> P:
  """A KV buffer's spec: batch (axis 0) over ``"data"``, heads over ``"tensor"``."""
  spec = list(batch_spec(mesh, shape[0], len(shape)))
  n = axis_size(mesh, TENSOR)
  if split_heads and n > 1 and shape[head_axis] % n == 0:
    spec[head_axis] = TENSOR
  return P(*spec)


def zeros(shape: Sequence[int], dtype, sharding: NamedSharding | None) -> jax.Array:
  """``jnp.zeros`` made on the devices of ``sharding``, each only its shard."""
  return jax.numpy.zeros(tuple(shape), dtype, device=sharding)


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


def add_cli_flag(parser) -> None:
  """``--mesh data=N,tensor=M`` for a command-line driver; read it with
  ``mesh_from_flag(args.mesh)`` before anything else touches JAX."""
  parser.add_argument(
      "--mesh", default=None,
      help="shard the target over a device mesh, e.g. data=1,tensor=8 (one size may "
           "be -1: the remaining devices); default: one device")


def mesh_from_flag(value: str | None) -> jax.sharding.Mesh | None:
  """The mesh a ``--mesh`` value names (None: one device). On a multi-host
  launch this first joins the hosts (``maybe_initialize_distributed``)."""
  if not value:
    return None
  maybe_initialize_distributed("auto")
  return parse_mesh(value)
