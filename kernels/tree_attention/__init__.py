"""Tree attention: one entry point, a jnp reference and Pallas kernels."""

from kernels.tree_attention.ops import tree_attention
from kernels.tree_attention.reference import tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
