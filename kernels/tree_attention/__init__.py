"""Tree attention: one entry point, a jnp reference and Pallas kernels."""

from kernels.tree_attention.common import CACHE_LAYOUTS, HEAD_MAJOR, TOKEN_MAJOR
from kernels.tree_attention.ops import cache_layout_for, tree_attention
from kernels.tree_attention.reference import tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference", "cache_layout_for",
           "CACHE_LAYOUTS", "HEAD_MAJOR", "TOKEN_MAJOR"]
