"""`Tree`: a draft tree with static shapes, as the verifier consumes it.

Conventions (shared by every tree builder):

- N = the node budget (``remain_total``); arrays have N+1 entries, index 0 is
  the root, whose token is the last committed (context) token.
- Valid draft nodes are indices 1..num_nodes; they are sorted by depth (BFS
  order) and ``parents[i] < i`` for each of them. A draft node of level l
  (0-based) has depth l+1; the root has depth 0 and parent -1.
- Padding nodes (index > num_nodes) have token 0, parent -1, depth 0, score
  -inf, a mask row with only the diagonal set, and appear in no path.
- ``mask[i, j]`` is True iff j is an ancestor of i or i itself.
- ``paths`` holds one row per leaf (valid node without valid children), leaves
  in node order, each the node indices root -> leaf padded with -1 to D+2
  columns (D+1 = draft levels); rows num_leaves..N-1 are all -1.
"""

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class Tree:
  """A padded draft tree (a pytree; batch it with vmap).

  Attributes:
    tokens: int32 [N+1] token of each node (target vocabulary).
    parents: int32 [N+1] parent node index (-1 for the root and padding).
    depth: int32 [N+1] root 0, draft level l -> l+1, padding 0.
    mask: bool [N+1, N+1] ancestor-or-self attention mask.
    num_nodes: int32 [] valid draft nodes (root excluded).
    paths: int32 [N, D+2] root-to-leaf node-index paths, -1 padded.
    num_leaves: int32 [] valid rows of `paths`.
    scores: float32 [N+1] search score of each node (root 0, padding -inf).
  """
  tokens: jax.Array
  parents: jax.Array
  depth: jax.Array
  mask: jax.Array
  num_nodes: jax.Array
  paths: jax.Array
  num_leaves: jax.Array
  scores: jax.Array

  @property
  def valid(self) -> jax.Array:
    """bool [..., N+1]: True for the root and the valid draft nodes."""
    return tree_valid(self.num_nodes, self.tokens.shape[-1])

  @property
  def max_nodes(self) -> int:
    """N, the static node budget (root excluded)."""
    return self.tokens.shape[-1] - 1


def tree_valid(num_nodes: jax.Array, size: int) -> jax.Array:
  """bool [..., size]: index <= num_nodes (the root is always valid)."""
  return jnp.arange(size) <= jnp.asarray(num_nodes)[..., None]


def build_tree(tokens: jax.Array, parents: jax.Array, depth: jax.Array,
               scores: jax.Array, num_nodes: jax.Array,
               max_depth: int) -> Tree:
  """Adds the ancestor mask and leaf paths to a node list.

  Args:
    tokens, parents, depth, scores: [N+1] per node, following the `Tree`
      conventions (BFS order, parents[i] < i, padding already filled in).
    num_nodes: int32 [] valid draft nodes.
    max_depth: static bound on the depth of any node (D+1).
  """
  size = tokens.shape[0]
  index = jnp.arange(size, dtype=jnp.int32)
  valid = index <= num_nodes
  # Small 0/1 matmuls (exact: sums of at most N+1 ones, f32 accumulation)
  # keep the compiled program short. reach = (I + A)^(2^t), A[i, parent(i)].
  dot = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
  edge = (parents[:, None] == index[None, :]).astype(jnp.float32)
  reach = jnp.eye(size, dtype=jnp.float32) + edge
  for _ in range(max(max_depth - 1, 0).bit_length()):
    reach = jnp.minimum(dot(reach, reach), 1.0)
  mask = reach > 0

  # Path row of each node: column c holds its ancestor at depth c.
  cols = jnp.arange(max_depth + 1, dtype=jnp.int32)
  at_depth = (depth[:, None] == cols[None, :]).astype(jnp.float32)
  rows = dot(reach * index[None, :].astype(jnp.float32), at_depth)
  rows = jnp.where(cols[None, :] <= depth[:, None], rows.astype(jnp.int32), -1)
  has_child = jnp.any((edge > 0) & (valid & (index > 0))[:, None], axis=0)
  is_leaf = valid & (index > 0) & ~has_child
  rank = jnp.cumsum(is_leaf) - 1
  pick = (is_leaf[None, :] & (rank[None, :] == index[:-1, None])).astype(
      jnp.float32)  # [N, N+1]: leaf number r -> its node.
  paths = dot(pick, (rows + 1).astype(jnp.float32)).astype(jnp.int32) - 1
  return Tree(
      tokens=tokens.astype(jnp.int32),
      parents=parents.astype(jnp.int32),
      depth=depth.astype(jnp.int32),
      mask=mask,
      num_nodes=jnp.asarray(num_nodes, jnp.int32),
      paths=paths,
      num_leaves=jnp.sum(is_leaf).astype(jnp.int32),
      scores=scores.astype(jnp.float32),
  )
