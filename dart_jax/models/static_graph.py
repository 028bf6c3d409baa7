"""NNX models as cheap arguments of jitted functions.

Every jitted call hashes its static arguments and compares them with the cached
ones. flax's ``GraphDef.__hash__`` walks every node of the model: 4-12 ms per
call for the 30-layer embedded model, on the order of a whole decode step's
compute on a CPU. ``static_graphdef`` returns an equal graph definition that
hashes once and compares by identity first.

The parameters are flattened on every call too, and an ``nnx.Variable`` is a
pytree node with a Python flatten rule: 273 of them cost ~0.8 ms a call for
the embedded model (a decode step computes in ~12 ms on the 2-core CPU).
``FlatTree`` holds a pytree already flattened, so a call flattens it with one
Python call.
"""

import dataclasses
from typing import Any

import jax
from flax import nnx

GraphDef = nnx.graph.GraphDef


class StaticGraphDef(GraphDef):
  """A ``GraphDef`` whose hash is computed once (the structure is immutable)."""

  __slots__ = ("_hash",)

  def __hash__(self) -> int:
    try:
      return self._hash
    except AttributeError:
      value = GraphDef.__hash__(self)
      object.__setattr__(self, "_hash", value)
      return value

  def __eq__(self, other: Any) -> bool:
    if self is other:
      return True
    if not isinstance(other, GraphDef) or hash(self) != hash(other):
      return False
    return (self.nodes, self.attributes, self.num_leaves) == (
        other.nodes, other.attributes, other.num_leaves)


def static_graphdef(graphdef: Any) -> Any:
  """``graphdef`` as a ``StaticGraphDef`` (other values are returned as they are)."""
  if isinstance(graphdef, StaticGraphDef) or not isinstance(graphdef, GraphDef):
    return graphdef
  return StaticGraphDef(nodes=graphdef.nodes, attributes=graphdef.attributes,
                        num_leaves=graphdef.num_leaves)


def use_static_graphdefs(obj: Any) -> None:
  """In a frozen dataclass's ``__post_init__``: every field named ``*graphdef``
  becomes a ``StaticGraphDef``."""
  for field in dataclasses.fields(obj):
    if field.name.endswith("graphdef"):
      object.__setattr__(obj, field.name, static_graphdef(getattr(obj, field.name)))


class FlatTree:
  """A pytree kept as (leaves, treedef), for the arrays a jitted function reads
  every call (parameters, tables).

  Passed to a jitted function it flattens to the same leaves as ``tree``, and
  inside the function it unflattens to ``tree``'s own structure (an
  ``nnx.State``, a dict), so the function body does not see the wrapper.
  """

  __slots__ = ("leaves", "treedef")

  def __init__(self, tree: Any):
    self.leaves, self.treedef = jax.tree.flatten(tree)


jax.tree_util.register_pytree_node(
    FlatTree, lambda flat: (flat.leaves, flat.treedef),
    lambda treedef, leaves: treedef.unflatten(leaves))
