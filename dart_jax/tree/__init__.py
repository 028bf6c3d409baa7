"""Draft trees: the `Tree` structure and the DART beam search.

  tree = dart_search(logits, context, ngram.to_table(), TreeConfig(), d2t)
"""

from dart_jax.tree.config import TreeConfig
from dart_jax.tree.dart_search import (dart_search, level_candidates, search_batch,
                                       search_candidates)
from dart_jax.tree.structure import Tree, build_tree, tree_valid

__all__ = ["TreeConfig", "Tree", "build_tree", "dart_search",
           "level_candidates", "search_batch", "search_candidates", "tree_valid"]

from dart_jax.draft.correction import CorrectionHead  # the builders' input (its home)
from dart_jax.tree.dartree import (TREE_METHODS, DARTreeConfig, dartree_build, level_widths,
                                   num_tree_nodes)

__all__ += ["TREE_METHODS", "CorrectionHead", "DARTreeConfig", "dartree_build",
            "level_widths", "num_tree_nodes"]
