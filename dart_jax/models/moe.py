"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral) with per-token routing.

Routing (as transformers does for both): ``probs = softmax(router(x))`` in float32
over all experts, the ``k`` largest are chosen (ties: lower expert id), and their
weights are renormalised to sum to one when ``norm_topk_prob``. Every token is routed
on its own and nothing is dropped (no capacity), so a token's output never depends
on the other tokens of the call: verifying a draft tree gives each node exactly what
decoding it alone would give, which keeps speculative decoding lossless.

Expert computation follows the chosen experts, not all of them:
- ``gather`` (few rows: decoding, verification): each row reads the weights of its
  k experts and runs them as batched dots, so the cost is rows * k expert matmuls
  whatever the number of experts;
- ``sorted`` (many rows: prefill): the (row, choice) pairs are sorted by expert and
  run as one grouped matmul (``jax.lax.ragged_dot``), every expert's weights read
  once; the cost is again rows * k matmuls.
``expert_impl="auto"`` picks ``gather`` on TPU/GPU while rows * k is below the number
of experts (then fewer expert matrices are read than a grouped pass reads), ``sorted``
above; on CPU always ``gather``: XLA:CPU runs ``ragged_dot`` as a pass over every
group, so its cost grows with the number of experts (``python -m infer.moe_bench``:
at T=1 / 9 / 64 tokens, 64 experts cost 8.1x / 7.9x / 7.2x of 8 experts in the sorted
form, 0.96x / 0.89x / 1.07x in the gather form).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.errors import CheckpointError
from dart_jax.models import layers
from dart_jax.models import precision as precision_lib
from dart_jax.models.precision import Precision

EXPERT_IMPLS = ("auto", "gather", "sorted")


class StackedDense(nnx.Module):
  """E matrices of one shape: ``kernel [E, in, out]`` or, in the fast modes,
  ``weight [E, out, in]`` (``precision.transposed_weights``), drawn like E
  ``layers.Dense`` layers."""

  def __init__(self, num: int, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32, stddev: float = 0.02):
    self.precision = precision_lib.resolve(precision)
    self.transposed = self.precision.transposed_weights
    matrix = layers.normal_init(stddev)(rngs.params(), (num, in_features, out_features),
                                        self.precision.weight_dtype)
    if self.transposed:
      self.weight = nnx.Param(jnp.swapaxes(matrix, 1, 2))
    else:
      self.kernel = nnx.Param(matrix)

  def matrices(self) -> jax.Array:
    """[E, in, out] (kernel) or [E, out, in] (weight), as stored."""
    return self.weight[...] if self.transposed else self.kernel[...]


class Experts(nnx.Module):
  """The experts' SwiGLU matrices, stacked: gate/up [E, H, I], down [E, I, H]."""

  def __init__(self, num: int, hidden: int, intermediate: int, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    self.gate_proj = StackedDense(num, hidden, intermediate, rngs=rngs, precision=precision)
    self.up_proj = StackedDense(num, hidden, intermediate, rngs=rngs, precision=precision)
    self.down_proj = StackedDense(num, intermediate, hidden, rngs=rngs, precision=precision)


def _parts(x: jax.Array, precision: Precision) -> jax.Array:
  """The activation rows as ``precision`` feeds them to a dot: [P, N, K] with P = 3
  exact bf16 parts (split3), else one part in the weight dtype."""
  if precision.dot == "split3":
    n = x.shape[0]
    return precision_lib.split3(x.astype(jnp.float32)).reshape(3, n, -1)
  return x.astype(precision.weight_dtype)[None]


def _sum_parts(out: jax.Array, precision: Precision) -> jax.Array:
  """The inverse of ``_parts`` on the products: as ``precision.matmul`` sums them."""
  return precision_lib.sum_split3(out) if precision.dot == "split3" else out[0]


def gathered_matmul(x: jax.Array, w: jax.Array, precision: Precision, *,
                    transposed: bool) -> jax.Array:
  """Row n times its own matrix: x [N, K], w [N, K, M] (or [N, M, K] transposed)
  -> [N, M] in ``precision.dtype``, with ``precision.matmul``'s numerics."""
  spec = "pnk,nmk->pnm" if transposed else "pnk,nkm->pnm"
  out = jnp.einsum(spec, _parts(x, precision), w.astype(precision.weight_dtype),
                   preferred_element_type=jnp.float32)
  return _sum_parts(out, precision).astype(precision.dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   precision: Precision, *, transposed: bool) -> jax.Array:
  """Rows grouped by expert (sorted): x [N, K], w [E, K, M] (or [E, M, K]),
  group_sizes [E] -> [N, M]; row n uses the matrix of its group."""
  if transposed:
    w = jnp.swapaxes(w, 1, 2)
  parts = _parts(x, precision)
  out = jnp.stack([jax.lax.ragged_dot(p, w.astype(precision.weight_dtype), group_sizes,
                                      preferred_element_type=jnp.float32)
                   for p in parts])
  return _sum_parts(out, precision).astype(precision.dtype)


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))``."""

  def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
               norm_topk_prob: bool, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32, expert_impl: str = "auto"):
    if expert_impl not in EXPERT_IMPLS:
      raise ValueError(f"expert_impl must be one of {EXPERT_IMPLS}, got {expert_impl!r}")
    self.precision = precision_lib.resolve(precision)
    self.router = layers.linear(hidden, num_experts, rngs=rngs, precision=precision)
    self.experts = Experts(num_experts, hidden, intermediate, rngs=rngs,
                           precision=precision)
    self.num_experts, self.top_k = num_experts, top_k
    self.norm_topk_prob = norm_topk_prob
    self.expert_impl = expert_impl

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, H] -> (weights float32 [N, k], experts int32 [N, k])."""
    probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, self.top_k)
    if self.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., H] -> [..., H]."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    weights, experts = self.route(rows)
    impl = self.expert_impl
    if impl == "auto":
      few = rows.shape[0] * self.top_k < self.num_experts
      impl = "gather" if few or jax.default_backend() == "cpu" else "sorted"
    out = (self._gather(rows, weights, experts) if impl == "gather"
           else self._sorted(rows, weights, experts))
    return out.reshape(*lead, out.shape[-1])

  def _expert_mlp(self, x, matmul):
    """SwiGLU of each row with its expert: ``matmul(x, projection)``."""
    e = self.experts
    hidden = jax.nn.silu(matmul(x, e.gate_proj)) * matmul(x, e.up_proj)
    return matmul(hidden, e.down_proj)

  def _gather(self, rows, weights, experts):
    n, k = experts.shape
    flat = experts.reshape(-1)
    pairs = jnp.repeat(rows, k, axis=0)  # [N*k, H], row n's choices together

    def matmul(x, proj):
      return gathered_matmul(x, proj.matrices()[flat], self.precision,
                             transposed=proj.transposed)

    out = self._expert_mlp(pairs, matmul).reshape(n, k, -1).astype(jnp.float32)
    return _combine(out, weights).astype(self.precision.dtype)

  def _sorted(self, rows, weights, experts):
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    pairs = rows[order // k]  # [N*k, H], grouped by expert
    group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)

    def matmul(x, proj):
      return grouped_matmul(x, proj.matrices(), group_sizes, self.precision,
                            transposed=proj.transposed)

    grouped = self._expert_mlp(pairs, matmul).astype(jnp.float32)
    out = jnp.zeros_like(grouped).at[order].set(grouped).reshape(n, k, -1)
    return _combine(out, weights).astype(self.precision.dtype)


def _combine(out: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_j weights[n, j] * out[n, j] in choice order: [N, k, H] -> [N, H] float32."""
  total = out[:, 0] * weights[:, :1]
  for j in range(1, out.shape[1]):
    total = total + out[:, j] * weights[:, j:j + 1]
  return total


# Released per-expert tensor names (per layer, expert e): Qwen3-MoE, Mixtral.
_PER_EXPERT = {
    "gate_proj": ("mlp.experts.{e}.gate_proj.weight", "block_sparse_moe.experts.{e}.w1.weight"),
    "up_proj": ("mlp.experts.{e}.up_proj.weight", "block_sparse_moe.experts.{e}.w3.weight"),
    "down_proj": ("mlp.experts.{e}.down_proj.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
_ROUTER = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
# Fused 3-D forms (newer transformers): gate_up [E, 2I, H] (gate rows first),
# down [E, H, I]; with or without a ``.weight`` suffix.
_FUSED_GATE_UP = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight")
_FUSED_DOWN = ("mlp.experts.down_proj", "mlp.experts.down_proj.weight")


def stack_expert_tensors(config, tensors, *, source: str = "") -> dict:
  """HF tensors with every sparse layer's experts in the stacked names the
  ``Transformer`` rules read: ``model.layers.N.mlp.gate.weight`` [E, H] and
  ``model.layers.N.mlp.experts.{gate,up,down}_proj.weight`` [E, out, in].

  Accepts per-expert tensors (``mlp.experts.e.gate_proj`` / Mixtral's
  ``block_sparse_moe.experts.e.w1``) and fused 3-D ones (``mlp.experts.gate_up_proj``).
  Raises CheckpointError naming what is missing.
  """
  out = dict(tensors)
  for layer in config.sparse_layers:
    prefix = f"model.layers.{layer}."

    def take(names, what):
      for name in names:
        if prefix + name in out:
          return out.pop(prefix + name)
      raise CheckpointError(f"{source}: layer {layer} has no {what} (looked for "
                            f"{', '.join(prefix + n for n in names)})")

    out[prefix + "mlp.gate.weight"] = take(_ROUTER, "router")
    fused = next((n for n in _FUSED_GATE_UP if prefix + n in out), None)
    if fused is not None:
      gate_up = np.asarray(out.pop(prefix + fused))
      half = gate_up.shape[1] // 2
      stacked = {"gate_proj": gate_up[:, :half], "up_proj": gate_up[:, half:],
                 "down_proj": np.asarray(take(_FUSED_DOWN, "fused down_proj"))}
    else:
      stacked = {proj: np.stack([np.asarray(take(tuple(n.format(e=e) for n in names),
                                                 f"expert {e} {proj}"))
                                 for e in range(config.num_experts)])
                 for proj, names in _PER_EXPERT.items()}
    for proj, array in stacked.items():
      out[f"{prefix}mlp.experts.{proj}.weight"] = array
  return out
