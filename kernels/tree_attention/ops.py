"""``tree_attention``: dispatch to the best implementation for the backend."""

import functools

import jax

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


@functools.partial(jax.jit, static_argnames=("impl", "scale", "interpret"))
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
) -> jax.Array:
  """Attention of T tree tokens over ``cache[:lengths]`` and the tree under a mask.

  Args:
    q: [B, T, Hq, hd] queries of the new (tree) tokens.
    k_cache, v_cache: [B, S, Hkv, hd]; only ``[:lengths[b]]`` of row b is used
      (the kernels never read past it, so pass the whole cache, not a slice).
    lengths: [B] int, valid cache entries per row (0 allowed).
    k_tree, v_tree: [B, T, Hkv, hd] keys/values of the tree tokens.
    tree_mask: [B, T, T] bool, ``tree_mask[b, i, j]``: tree token i sees token j.
    impl: "auto" (TPU kernel on TPU, GPU kernel on GPU, XLA reference on CPU),
      "xla", "pallas_tpu" or "pallas_gpu".
    scale: softmax scale, default ``hd ** -0.5``.
    interpret: run a Pallas kernel in interpret mode (CPU testing); ignored by
      "xla".

  Returns:
    [B, T, Hq, hd] in q's dtype; softmax in float32; a query that sees nothing
    gives zeros. Prefill (causal mask), decode (T=1) and tree verification are
    all this one call.
  """
  common.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
  impl = resolve_impl(impl)
  args = (q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
  if impl == "pallas_tpu":
    return pallas_tpu.tree_attention_pallas_tpu(*args, scale=scale, interpret=interpret)
  if impl == "pallas_gpu":
    return pallas_gpu.tree_attention_pallas_gpu(*args, scale=scale, interpret=interpret)
  return tree_attention_reference(*args, scale=scale)
