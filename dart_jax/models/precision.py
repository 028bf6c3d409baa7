"""The library's one matmul policy: how weights are stored and dense layers run.

Every dense layer (target, draft heads, tied or untied LM heads) calls ``matmul``
with its module's ``Precision``. Modes:

- ``float32``: float32 weights and activations, plain float32 dots (exact mode).
- ``fast`` (the CPU default for targets): weights stored in bfloat16; activations,
  norms, attention, softmax and KV caches in float32. Each dot splits the float32
  activation exactly into three bfloat16 parts (``hi + mid + lo``, the remainder is
  ~2^-24 |x|), stacks them as extra rows of ONE bf16 x bf16 -> f32 dot and sums
  the row blocks. bf16 products are exact in float32, so the result is as accurate
  as a float32 dot of the same (bf16) weights, while XLA:CPU runs it on its AMX
  path whose cost is nearly flat in the number of rows. Accuracy is
  what keeps speculative decoding lossless: a target whose numerics depended on
  how many tokens a call holds would verify a tree differently than it decodes.
- ``fast-rows`` (drafters in fast mode, and work whose numerics need not match the
  target's decode exactly): bf16 weights, activations rounded to bf16 rows, float32
  accumulation. The cheapest form; a draft model's numerics cannot break
  losslessness, only acceptance. (Where the CPU kernel below runs, it is both
  cheaper and exact, so there ``fast-rows`` computes like ``fast``.)
- ``bfloat16`` (TPU/GPU default): bfloat16 weights and activations, native dots.

Measured on the 2-core AVX512-BF16 CPU (``python -m infer.precision_bench``):
plain bf16 x bf16 -> bf16 dots are several times slower than float32, and a
one-row bf16 dot takes a slow path, so one-row ``fast-rows`` dots are padded to
two rows (``fast`` has three rows per input row already).

On x86-64 CPUs the float32-activation modes run their dots through
``kernels.cpu_matmul`` (an FFI kernel, the same numbers for a token whatever the
call's size) for calls of at most ``CPU_KERNEL_MAX_TOKENS`` tokens per sequence:
decode steps and tree verification. Without a bf16 matrix unit (no AMX-BF16;
AVX512-BF16 alone, as on AMD Zen 4) XLA:CPU has no fast bf16 path and its
float32 dot grows steeply from one row to two; the kernel's AVX2 + FMA loop does
float32 math on the stored weights. With AMX-BF16 the kernel runs bf16 weights
on the tile unit (the split3 parts as tile columns), faster at those sizes than
XLA's own AMX dot. Without AMX the ``fast`` and ``fast-rows`` modes store their
dense matrices as panels ``[out / 8, in, 8]`` for the kernel's panel form (``weight_layout``),
which makes tree-sized calls far cheaper there. Longer calls (prefill
of long prompts, training features) widen bf16 weights to float32 and run XLA's
float32 dot, which is as fast there (``_widens_weights``); the ``rows`` form
keeps XLA's bf16 dot on a CPU with AVX512-BF16, where it is faster.
"""

import contextlib
import dataclasses
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from dart_jax.errors import ConfigError
from kernels import cpu_matmul

DOT_FORMS = ("native", "split3", "rows")


@dataclasses.dataclass(frozen=True)
class Precision:
  """A numeric mode of a model.

  name: "float32", "fast", "fast-rows" or "bfloat16" (or "float16").
  weight_dtype: dense kernels and embedding tables.
  dtype: activations, norm scales and other small parameters, KV caches.
  dot: how ``matmul`` runs a dense layer: "native" (operands in their dtype),
    "split3" (exact 3-part bf16 split of the activation) or "rows" (activation
    rounded to bf16).
  transposed_weights: dense layers store their matrix as ``weight [out, in]``
    (the checkpoint layout) instead of ``kernel [in, out]``. XLA:CPU's bf16 dot
    path runs a 30-layer SmolLM2-sized stack ~30% faster that way (17.5 vs
    24.5 ms at one row, 20.6 vs 28.5 ms at 9, against 21.5 / 44.0 ms in
    float32), so the fast modes use it.
  """

  name: str
  weight_dtype: Any
  dtype: Any
  dot: str
  transposed_weights: bool = False

  def __post_init__(self):
    if self.dot not in DOT_FORMS:
      raise ConfigError(f"Precision.dot must be one of {DOT_FORMS}, got {self.dot!r}")

  def for_drafter(self) -> "Precision":
    """The mode a draft model of a target in this mode runs in (the cheapest
    form of the same storage: drafter numerics only affect acceptance)."""
    return FAST_ROWS if self.dot == "split3" else self

  def uniform(self) -> "Precision":
    """Every weight in the compute dtype (small matrices read as float32 math,
    e.g. Domino's GRU and projections), native dots."""
    return of_dtype(self.dtype)


FLOAT32 = Precision("float32", jnp.float32, jnp.float32, "native")
BFLOAT16 = Precision("bfloat16", jnp.bfloat16, jnp.bfloat16, "native")
FAST = Precision("fast", jnp.bfloat16, jnp.float32, "split3", transposed_weights=True)
FAST_ROWS = Precision("fast-rows", jnp.bfloat16, jnp.float32, "rows",
                      transposed_weights=True)
_NAMED = {p.name: p for p in (FLOAT32, BFLOAT16, FAST, FAST_ROWS)}
NAMES = tuple(_NAMED)


def of_dtype(dtype) -> Precision:
  """The uniform mode of one dtype: weights and activations both ``dtype``."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return FLOAT32
  if dtype == jnp.bfloat16:
    return BFLOAT16
  if jnp.issubdtype(dtype, jnp.floating):
    return Precision(dtype.name, dtype, dtype, "native")
  raise ConfigError(f"a model dtype must be floating, got {dtype}")


CPU_KERNEL_MAX_TOKENS = 128
"""Calls of at most this many tokens per sequence use ``kernels.cpu_matmul`` where
it runs (above it XLA's dot is as fast: measured 128-256 rows, SmolLM2 shapes).
Per sequence, not per call, so a batch verifies a tree with the same numbers as
it decodes."""


_kernel_switch: list[bool] = []  # innermost ``cpu_kernel(...)`` setting, if any


def cpu_kernel_active() -> bool:
  """True where the float32-activation modes run their dots through
  ``kernels.cpu_matmul``: the CPU backend with the kernel built
  (``DART_JAX_CPU_MATMUL=0`` turns it off). Also on a CPU with AMX, where the
  kernel's tile path beats XLA's split3 bf16 dot at decode and tree sizes (2-core
  Sapphire Rapids-class Xeon, jax 0.10.2: a one-token pass of the embedded model
  19.9 ms with the kernel's AVX2 path vs 29.4 ms with XLA's AMX dot)."""
  if _kernel_switch and not _kernel_switch[-1]:
    return False
  return jax.default_backend() == "cpu" and cpu_matmul.available()


@contextlib.contextmanager
def cpu_kernel(enabled: bool) -> Iterator[None]:
  """Within the block, functions traced anew use the CPU kernel only if
  ``enabled`` (and it is active). For side-by-side benchmarks: clear jit caches
  (``jax.clear_caches()``) so that programs are traced again."""
  _kernel_switch.append(enabled)
  try:
    yield
  finally:
    _kernel_switch.pop()


PANELS_ENV_SWITCH = "DART_JAX_CPU_PANELS"
_panel_switch: list[bool] = []  # innermost ``panel_weights(...)`` setting, if any


def panel_weights_active() -> bool:
  """True where ``fast``-mode dense layers built now store their matrix as panels
  (``weight_layout``): the CPU kernel runs and takes bf16 weights on its AVX2
  path (no AMX: the tile path reads ``[out, in]``), on a single device (sharded
  loading reads each device's slices of the ``[out, in]`` tensors, and the
  sharding rules split that layout). ``DART_JAX_CPU_PANELS=0`` or
  ``panel_weights(False)`` keep ``[out, in]``."""
  if _panel_switch and not _panel_switch[-1]:
    return False
  if os.environ.get(PANELS_ENV_SWITCH, "1").lower() in ("0", "false", "off"):
    return False
  return cpu_kernel_active() and not cpu_matmul.amx_active() and jax.device_count() == 1


@contextlib.contextmanager
def panel_weights(enabled: bool) -> Iterator[None]:
  """Within the block, dense layers built anew use the panel layout only if
  ``enabled`` (and ``panel_weights_active()``). Sharded targets are built with
  it off; benchmarks use it to compare the two layouts in one process."""
  _panel_switch.append(enabled)
  try:
    yield
  finally:
    _panel_switch.pop()


WEIGHT_LAYOUTS = ("kernel", "weight", "panels")


def weight_layout(precision: Precision, out_features: int) -> str:
  """How a dense layer of ``out_features`` outputs stores its matrix in ``precision``.

  "kernel": ``kernel [in, out]`` (the uniform modes); "weight": ``weight [out, in]``
  (``precision.transposed_weights``); "panels": ``panels [out / 8, in, 8]``, bf16,
  for the ``fast`` and ``fast-rows`` modes where ``panel_weights_active()``.

  Why panels: with ``[out, in]`` rows the CPU kernel's tree-sized calls are bound
  by their FMAs (a dot per output, an x load per FMA, a lane sum per output); the
  panel form broadcasts x against 8 outputs per FMA. A 7-token pass of the
  embedded model (2-core Zen 3, one process alternating) fell from 36.0 to 27.9
  ms, a one-token pass from 16.8 to 16.2 ms (``kernels/README.md``). Drafters
  (``fast-rows``) call the same kernel with as many rows (the DART head: 6-11
  per round), so they use panels too; MoE experts keep ``[out, in]``.
  """
  if not precision.transposed_weights:
    return "kernel"
  if (precision.dot in ("split3", "rows") and jnp.dtype(precision.weight_dtype) == jnp.bfloat16
      and out_features % cpu_matmul.PANEL == 0 and panel_weights_active()):
    return "panels"
  return "weight"


def default() -> Precision:
  """``bfloat16`` on TPU/GPU. On CPU ``fast`` (bf16 weights: half the bytes to
  read), except on a CPU that has neither a bf16 matrix unit nor the AVX2 kernel,
  where XLA's bf16 dots are slower than float32 ones and ``float32`` is faster."""
  if jax.default_backend() != "cpu":
    return BFLOAT16
  return FAST if cpu_matmul.cpu_has_bf16_matrix_unit() or cpu_kernel_active() else FLOAT32


def resolve(spec: "Precision | str | Any | None") -> Precision:
  """A ``Precision`` from a mode, its name, a dtype (its uniform mode), or None
  (``default()``)."""
  if spec is None:
    return default()
  if isinstance(spec, Precision):
    return spec
  if isinstance(spec, str) and spec in _NAMED:
    return _NAMED[spec]
  try:
    return of_dtype(spec)
  except TypeError as e:
    raise ConfigError(f"unknown precision {spec!r}: use one of {NAMES} or a "
                      "floating dtype") from e


def of_drafter(spec, target=None) -> Precision:
  """A draft model's mode: ``spec`` resolved if given, else its target's
  ``for_drafter()`` (``default().for_drafter()`` without a target)."""
  if spec is not None:
    return resolve(spec)
  return (target.precision if target is not None else default()).for_drafter()


def add_cli_flag(parser) -> None:
  """``--precision auto|fast|float32|...`` for a command-line driver; read it with
  ``resolve_flag(args.precision)``."""
  parser.add_argument(
      "--precision", default="auto", choices=("auto",) + NAMES,
      help="numeric mode: auto (fast on CPU: bf16 weights, float32-accurate "
           "activations; bfloat16 on TPU/GPU), float32 (exact), bfloat16, fast-rows")


def resolve_flag(value: str) -> Precision:
  """The ``Precision`` a ``--precision`` value names ("auto" = ``default()``)."""
  return resolve(None if value == "auto" else value)


def split3(x: jax.Array) -> jax.Array:
  """float32 ``x [M, K]`` -> ``[3M, K]`` bf16 rows ``hi, mid, lo`` with
  ``hi + mid + lo == x`` up to ~2^-24 |x| (each remainder is exact in float32)."""
  hi = x.astype(jnp.bfloat16)
  rest = x - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return jnp.concatenate([hi, mid, lo], axis=0)


def sum_split3(parts: jax.Array) -> jax.Array:
  """``[3, ...]`` products of split3's hi / mid / lo parts -> their float32 sum,
  smallest parts first (their sum is exact before it meets ``hi``)."""
  return parts[0] + (parts[1] + parts[2])


def _uses_cpu_kernel(x: jax.Array, w: jax.Array, precision: Precision,
                     transposed: bool) -> bool:
  """Whether ``matmul`` runs this call through ``kernels.cpu_matmul``: a
  float32-activation mode, float32 or bf16 weights stored ``[out, in]`` (the fast
  modes' layers and every tied LM head), at most ``CPU_KERNEL_MAX_TOKENS`` tokens
  per sequence (``x [..., T, K]``).

  Weights stored ``[in, out]`` (the float32 mode's layers) keep XLA's dot: a
  kernel for that layout read it down strided columns, which on this project's
  CPU made a float32 decode step slower (AR 26.0 -> 20.5 tok/s) although trees
  got cheaper, so it was removed. The choice depends on the layer, never on T, so a layer computes a
  token the same way in a decode step and in a tree."""
  tokens = x.shape[-2] if x.ndim >= 2 else 1
  return (transposed and precision.dtype == jnp.float32
          and tokens <= CPU_KERNEL_MAX_TOKENS
          and jnp.dtype(w.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
          and cpu_kernel_active())


def _widens_weights(w: jax.Array, precision: Precision) -> bool:
  """Whether ``matmul`` widens bf16 weights to float32 (exactly) and runs a
  float32 dot: a float32-activation mode on a CPU without a bf16 matrix unit, in
  a call the CPU kernel does not take (more than ``CPU_KERNEL_MAX_TOKENS`` tokens:
  prefill, training features). XLA:CPU has no fast bf16 path there: on the AVX2
  CPU a 512-token pass of the embedded model takes 5.2-5.7 s with the split3
  bf16 dot, 1.9-2.2 s widened, 1.7-1.8 s in the float32 mode. Except the
  ``rows`` form on a CPU with a bf16 dot instruction (AVX512-BF16): its one bf16
  row per row runs at about twice the widened rate there (training features of
  four 512-token rows: 0.91 s per row in ``fast-rows``, 1.29 in ``fast``)."""
  if precision.dot == "rows" and cpu_matmul.cpu_has_bf16_dot_instruction():
    return False
  return (jnp.dtype(w.dtype) == jnp.dtype(jnp.bfloat16) and precision.dtype == jnp.float32
          and jax.default_backend() == "cpu" and not cpu_matmul.cpu_has_bf16_matrix_unit())


def matmul(x: jax.Array, w: jax.Array, precision: Precision, *,
           transposed: bool = False, panels: bool = False) -> jax.Array:
  """``x @ w`` as ``precision`` says; the library's only dense-layer dot.

  Args:
    x: [..., K] activations.
    w: [K, N] kernel, [N, K] with ``transposed`` (also an embedding table used
      as a tied LM head), or [N / 8, K, 8] with ``panels`` (``weight_layout``).
    precision: the calling module's mode.
  Returns:
    [..., N] in ``precision.dtype``.
  """
  contract = ((1,), (1,)) if transposed or panels else ((1,), (0,))
  lead = x.shape[:-1]
  rows = x.reshape(-1, x.shape[-1])
  m = rows.shape[0]
  if panels and _uses_cpu_kernel(x, w, precision, True):
    out = cpu_matmul.panels_matmul(rows.astype(jnp.float32), w)
  elif _uses_cpu_kernel(x, w, precision, transposed):
    out = cpu_matmul.rows_matmul(rows.astype(jnp.float32), w)
  elif _widens_weights(w, precision):
    out = jax.lax.dot_general(rows.astype(jnp.float32), w.astype(jnp.float32),
                              (contract, ((), ())), preferred_element_type=jnp.float32)
  elif precision.dot == "native":
    out = jax.lax.dot_general(rows.astype(w.dtype), w, (contract, ((), ())),
                              preferred_element_type=precision.dtype)
  elif precision.dot == "split3":
    parts = jax.lax.dot_general(split3(rows.astype(jnp.float32)), w, (contract, ((), ())),
                                preferred_element_type=jnp.float32).reshape(3, m, -1)
    out = sum_split3(parts)
  else:  # rows
    lhs = rows.astype(jnp.bfloat16)
    if m == 1:  # A one-row bf16 dot takes XLA:CPU's slow path.
      lhs = jnp.concatenate([lhs, lhs], axis=0)
    out = jax.lax.dot_general(lhs, w, (contract, ((), ())),
                              preferred_element_type=jnp.float32)[:m]
  out = out.reshape(m, -1)  # panels: [M, N / 8, 8] from XLA's dots
  return out.astype(precision.dtype).reshape(*lead, out.shape[-1])
