"""static_graph: graph definitions that hash once, equal to flax's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.models import static_graph
from dart_jax.models.layers import Dense


def _graphdef(use_bias=False):
  return nnx.split(Dense(3, 4, rngs=nnx.Rngs(0), use_bias=use_bias))


def test_equal_to_and_hashes_like_the_flax_graphdef():
  graphdef, _ = _graphdef()
  fast = static_graph.static_graphdef(graphdef)
  assert isinstance(fast, nnx.graph.GraphDef)
  assert fast == graphdef and hash(fast) == hash(graphdef)
  assert fast != static_graph.static_graphdef(_graphdef(use_bias=True)[0])
  assert static_graph.static_graphdef(fast) is fast
  assert static_graph.static_graphdef("not a graph") == "not a graph"


def test_a_jitted_function_compiles_once_for_equal_static_graphdefs():
  graphdef, params = _graphdef()
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def apply(graphdef, params, x):
    traces.append(1)
    return nnx.merge(graphdef, params)(x)

  x = jnp.ones((2, 3))
  one = apply(static_graph.static_graphdef(graphdef), params, x)
  two = apply(static_graph.static_graphdef(_graphdef()[0]), params, x)  # equal, new object
  assert len(traces) == 1
  assert jnp.array_equal(one, nnx.merge(graphdef, params)(x)) and jnp.array_equal(one, two)


def test_frozen_dataclass_fields_named_graphdef_are_converted():
  @dataclasses.dataclass(frozen=True)
  class Holder:
    graphdef: object
    head_graphdef: object
    other: object

    def __post_init__(self):
      static_graph.use_static_graphdefs(self)

  graphdef, _ = _graphdef()
  held = Holder(graphdef, graphdef, graphdef)
  assert isinstance(held.graphdef, static_graph.StaticGraphDef)
  assert isinstance(held.head_graphdef, static_graph.StaticGraphDef)
  assert not isinstance(held.other, static_graph.StaticGraphDef)


def test_flat_tree_passes_the_same_leaves_and_unflattens_to_the_tree_inside_jit():
  graphdef, params = _graphdef(use_bias=True)
  flat = static_graph.FlatTree(params)
  assert jax.tree.leaves(flat) == jax.tree.leaves(params)
  seen = []

  @functools.partial(jax.jit, static_argnums=0)
  def apply(graphdef, params, x):
    seen.append(type(params))
    return nnx.merge(graphdef, params)(x)

  x = jnp.ones((2, 3))
  assert jnp.array_equal(apply(graphdef, flat, x), nnx.merge(graphdef, params)(x))
  assert seen == [type(params)]  # the body sees the State, not the wrapper
  apply(graphdef, static_graph.FlatTree(params), x)  # a new wrapper of the same tree
  assert len(seen) == 1
