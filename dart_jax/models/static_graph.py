"""NNX graph definitions as cheap static arguments of jitted functions.

Every jitted call hashes its static arguments and compares them with the cached
ones. flax's ``GraphDef.__hash__`` walks every node of the model: 4-12 ms per
call for the 30-layer embedded model, on the order of a whole decode step's
compute on a CPU. ``static_graphdef`` returns an equal graph definition that
hashes once and compares by identity first.
"""

import dataclasses
from typing import Any

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
