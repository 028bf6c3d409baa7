"""``tree_attention``: dispatch to the best implementation for the backend."""

import functools

import jax
import jax.numpy as jnp

from kernels import cpu_matmul
from kernels.tree_attention import common
from kernels.tree_attention import pallas_gpu
from kernels.tree_attention import pallas_tpu
from kernels.tree_attention.reference import tree_attention_reference

IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """Maps ``impl`` to a concrete implementation for ``backend`` (default: JAX's).

  "auto" is the TPU kernel on TPU, the GPU kernel on GPU and the XLA reference
  elsewhere (CPU).
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown tree_attention impl {impl!r}; use one of {IMPLS}")
  if impl != "auto":
    return impl
  backend = jax.default_backend() if backend is None else backend
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu",
          "rocm": "pallas_gpu"}.get(backend, "xla")


CPU_KERNEL_MAX_TREE = 64
"""The most new tokens per row that ``impl="xla"`` sends to the fused CPU
kernel; longer calls (prefill) keep XLA's dots, which batch many rows better."""


def cpu_kernel_runs(num_tree: int, head_dim: int, cache_dtype, cache_layout: str,
                    backend: str | None = None) -> bool:
  """Whether ``impl="xla"`` runs ``cpu_matmul.tree_attention`` (one fused FFI
  call per layer) instead of the XLA reference: on the CPU backend where the
  kernel is built, head-major caches of float32 / bf16, ``head_dim`` in
  ``cpu_matmul.ATTENTION_HEAD_DIMS`` and at most ``CPU_KERNEL_MAX_TREE`` new
  tokens. It reads only each row's first ``lengths`` cache positions, so the
  caller passes the whole buffer (no prefix slice)."""
  backend = jax.default_backend() if backend is None else backend
  return (backend == "cpu" and cache_layout == common.HEAD_MAJOR
          and num_tree <= CPU_KERNEL_MAX_TREE and head_dim in cpu_matmul.ATTENTION_HEAD_DIMS
          and jnp.dtype(cache_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
          and cpu_matmul.available())


def cache_layout_for(impl: str, backend: str | None = None) -> str:
  """The KV-cache layout ``impl`` reads: head-major for the XLA path,
  token-major for the Pallas kernels (see ``common.CACHE_LAYOUTS``)."""
  impl = resolve_impl(impl, backend)
  return common.HEAD_MAJOR if impl == "xla" else common.TOKEN_MAJOR


@functools.partial(jax.jit, static_argnames=("impl", "scale", "interpret", "cache_layout"))
def tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    impl: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
    cache_layout: str = common.TOKEN_MAJOR,
) -> jax.Array:
  """Attention of T tree tokens over ``cache[:lengths]`` and the tree under a mask.

  Args:
    q: [B, T, Hq, hd] queries of the new (tree) tokens.
    k_cache, v_cache: [B, S, Hkv, hd] (token-major), or [B, Hkv, S, hd] with
      ``cache_layout="bhsd"`` (head-major, the XLA path only); only the first
      ``lengths[b]`` positions of row b are used (the kernels never read past
      them, so pass the whole cache, not a slice).
    lengths: [B] int, valid cache entries per row (0 allowed).
    k_tree, v_tree: [B, T, Hkv, hd] keys/values of the tree tokens.
    tree_mask: [B, T, T] bool, ``tree_mask[b, i, j]``: tree token i sees token j.
    impl: "auto" (TPU kernel on TPU, GPU kernel on GPU, "xla" on CPU),
      "xla" (the reference; on CPU with a head-major cache the fused FFI
      kernel where ``cpu_kernel_runs``), "pallas_tpu" or "pallas_gpu".
    scale: softmax scale, default ``hd ** -0.5``.
    interpret: run a Pallas kernel in interpret mode (CPU testing); ignored by
      "xla".
    cache_layout: "bshd" (token-major, every implementation) or "bhsd"
      (head-major, "xla"); ``cache_layout_for(impl)`` is the layout each one
      prefers.

  Returns:
    [B, T, Hq, hd] in q's dtype; softmax in float32; a query that sees nothing
    gives zeros. Prefill (causal mask), decode (T=1) and tree verification are
    all this one call.
  """
  common.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask,
                      cache_layout)
  impl = resolve_impl(impl)
  args = (q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
  if impl != "xla" and cache_layout != common.TOKEN_MAJOR:
    raise ValueError(f"tree_attention impl {impl!r} reads the token-major cache "
                     f"[B, S, Hkv, hd] ({common.TOKEN_MAJOR!r}); got cache_layout "
                     f"{cache_layout!r}")
  if impl == "pallas_tpu":
    return pallas_tpu.tree_attention_pallas_tpu(*args, scale=scale, interpret=interpret)
  if impl == "pallas_gpu":
    return pallas_gpu.tree_attention_pallas_gpu(*args, scale=scale, interpret=interpret)
  if cpu_kernel_runs(q.shape[1], q.shape[3], k_cache.dtype, cache_layout):
    return cpu_matmul.tree_attention(*args, common.default_scale(q.shape[3], scale))
  return tree_attention_reference(*args, scale=scale, cache_layout=cache_layout)
