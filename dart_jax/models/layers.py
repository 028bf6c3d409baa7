"""Building blocks shared by the target models and the draft heads."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.models import precision as precision_lib
from dart_jax.models.precision import Precision
from kernels import cpu_matmul


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32 (as HF does), scale applied in the input dtype."""

  def __init__(self, dim: int, eps: float, *, precision: Precision | Any = jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), precision_lib.resolve(precision).dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def normal_init(stddev: float):
  """normal(stddev) drawn in float32 whatever the storage dtype, so a model's
  random init in any precision is the rounded float32 one (same seed)."""
  draw = nnx.initializers.normal(stddev)
  return lambda key, shape, dtype=jnp.float32: draw(key, shape, jnp.float32).astype(dtype)


class Dense(nnx.Module):
  """``x @ W (+ bias)`` through ``precision.matmul``.

  The matrix is stored as ``precision.weight_layout`` says: ``kernel [in, out]``
  (the uniform modes), ``weight [out, in]`` (the fast modes: XLA:CPU's bf16 dots
  are faster on that layout) or ``panels [out / 8, in, 8]`` (the ``fast`` mode
  where the CPU kernel's panel form runs), in ``precision.weight_dtype``; the
  bias and the output are in ``precision.dtype``. Checkpoint I/O converts
  ``kernel`` and ``panels`` leaves (``dart_jax.models.checkpoint``).
  """

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32, use_bias: bool = False,
               stddev: float = 0.02):
    self.precision = precision_lib.resolve(precision)
    self.layout = precision_lib.weight_layout(self.precision, out_features)
    self.transposed = self.layout != "kernel"
    # Drawn as [in, out] in every layout: the same seed gives the same layer.
    matrix = normal_init(stddev)(rngs.params(), (in_features, out_features),
                                 self.precision.weight_dtype)
    if self.layout == "panels":
      self.panels = nnx.Param(cpu_matmul.to_panels(matrix.T))
    elif self.transposed:
      self.weight = nnx.Param(matrix.T)
    else:
      self.kernel = nnx.Param(matrix)
    if use_bias:
      self.bias = nnx.Param(jnp.zeros((out_features,), self.precision.dtype))
    self.use_bias = use_bias

  def stored(self) -> jax.Array:
    """The matrix as stored (``kernel``, ``weight`` or ``panels``)."""
    if self.layout == "panels":
      return self.panels[...]
    return self.weight[...] if self.transposed else self.kernel[...]

  def matrix(self) -> jax.Array:
    """The matrix as ``weight [out, in]`` (``transposed``) or ``kernel [in, out]``."""
    stored = self.stored()
    return cpu_matmul.from_panels(stored) if self.layout == "panels" else stored

  def apply(self, x: jax.Array, precision: Precision) -> jax.Array:
    """The layer's matmul in another module's mode (a drafter reading a target
    LM head); no bias. x: [..., in] -> [..., out]."""
    return precision_lib.matmul(x, self.stored(), precision, transposed=self.transposed,
                                panels=self.layout == "panels")

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., in] -> [..., out]."""
    out = self.apply(x, self.precision)
    return out + self.bias[...] if self.use_bias else out


def linear(in_features: int, out_features: int, *, rngs: nnx.Rngs,
           precision: Precision | Any = jnp.float32, use_bias: bool = False,
           stddev: float = 0.02) -> Dense:
  """A dense layer with a [in, out] kernel and normal(stddev) init."""
  return Dense(in_features, out_features, rngs=rngs, precision=precision,
               use_bias=use_bias, stddev=stddev)


class SwiGLU(nnx.Module):
  """``down(silu(gate(x)) * up(x))``."""

  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.gate_proj = linear(hidden, intermediate, rngs=rngs, precision=precision)
    self.up_proj = linear(hidden, intermediate, rngs=rngs, precision=precision)
    self.down_proj = linear(intermediate, hidden, rngs=rngs, precision=precision)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables for rotate-half RoPE.

  Args:
    positions: [..., T] int positions.
    inv_freq: [hd/2] inverse frequencies.
  Returns:
    cos, sin: [..., T, hd/2] float32.
  """
  def tables(positions):
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)

  if jax.default_backend() != "cpu":
    return tables(positions)
  # XLA:CPU fuses the cos and sin into each consumer, so every layer's q and k
  # rotation evaluates them again for every (token, head, lane): 2L fusions of
  # ~17 us each in a 7-token pass of the embedded model (optimization_barrier is
  # gone before fusion there). A conditional's result is a buffer its consumers
  # read, so the tables are computed once: -0.9 ms a 6-token pass on the 2-core
  # Zen 3 (one process, alternating). Both branches are the same function.
  return jax.lax.cond(jnp.all(positions >= 0), tables, tables, positions)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x: [B, T, H, hd]; cos/sin: [B, T, hd/2]."""
  half = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return out.astype(x.dtype)


def _at_positions(cache: jax.Array, positions: jax.Array, axis: int) -> tuple:
  """The index ``cache[b, ..., positions[b, j], ...]`` (positions on ``axis``);
  with the advanced indices first, its result is [B, J, (the other axes)]."""
  return ((jnp.arange(cache.shape[0])[:, None],) + (slice(None),) * (axis - 1)
          + (positions,))


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array, axis: int = 1
               ) -> jax.Array:
  """Writes ``rows`` into ``cache`` at per-sequence offsets, in place when donated.

  Args:
    cache: [B, S, ...] buffer, or S on another ``axis`` (>= 1).
    rows: [B, T, (cache's other axes)] new entries.
    start: [B] int offsets; row b goes to positions ``start[b]:start[b]+T``.
  Returns:
    The updated cache; entries that would land past S are dropped.
  """
  # A scatter updates only the T rows; a vmapped dynamic_update_slice becomes a
  # select over the whole buffer, i.e. a full copy of the cache per call.
  positions = start[:, None] + jnp.arange(rows.shape[1])[None, :]
  if rows.shape[1] == 1:
    # One row twice (the same value, so either write wins): XLA:CPU turns a
    # one-row scatter into a dynamic-update-slice, fuses that into the
    # attention's prefix slice of the buffer and then copies every layer's
    # whole K and V buffers twice to keep the old ones (SmolLM2-135M, 512-row
    # cache: a decode step 19-22 -> 16 ms).
    rows = jnp.concatenate([rows, rows], axis=1)
    positions = jnp.concatenate([positions, positions], axis=1)
  return cache.at[_at_positions(cache, positions, axis)].set(rows.astype(cache.dtype),
                                                             mode="promise_in_bounds")


def gather_rows(cache: jax.Array, index: jax.Array, axis: int = 1) -> jax.Array:
  """``cache[b, ..., index[b, j], ...]`` (positions on ``axis``) -> [B, J, ...]."""
  return cache[_at_positions(cache, index, axis)]
