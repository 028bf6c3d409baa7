"""The Domino correction, in one place: its parameters, and its math as plain arrays.

Domino (``docs/algorithms.md``, "DARTree") corrects a drafter's per-depth base
logits along a path: a one-layer GRU (no bias) over the TARGET embeddings of the
path gives a state s, and

    logits_d(x | path) = base_{d-1}[x] + W2[x] . SiLU(W_z hid_{d-1} + W_s s_{d-1})

where ``[W_z | W_s]`` is ``embed_proj_in`` and ``W2`` is ``embed_proj_out``.

- ``add_correction_params`` puts the three parameter groups (``prefix_gru``,
  ``embed_proj_in``, ``embed_proj_out``, the Domino release's names) on a
  module: DFlash's Domino head and the DART-GRU correction both use it.
- ``correction_head_of`` reads them into a ``CorrectionHead``: float32 arrays
  with the GRU step and the bias, what the tree builders
  (``dart_jax.tree.dartree``) and training call.
"""

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dart_jax.models import layers
from dart_jax.models import precision as precision_lib
from dart_jax.models.precision import Precision


class GRU(nnx.Module):
  """Kernels of a one-layer GRU without bias (gates r, z, n as in torch).

  input_kernel: [in, 3G] (= torch ``weight_ih_l0.T``); hidden_kernel: [G, 3G].
  """

  def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs,
               precision: Precision | Any = jnp.float32):
    dtype = precision_lib.resolve(precision).dtype
    init = nnx.initializers.uniform(2.0 / math.sqrt(hidden))
    shift = 1.0 / math.sqrt(hidden)  # torch's U(-1/sqrt(G), 1/sqrt(G))
    self.input_kernel = nnx.Param(
        (init(rngs.params(), (in_features, 3 * hidden)) - shift).astype(dtype))
    self.hidden_kernel = nnx.Param(
        (init(rngs.params(), (hidden, 3 * hidden)) - shift).astype(dtype))


def add_correction_params(module: nnx.Module, hidden_size: int, gru_hidden_dim: int,
                          emb_dim: int, vocab_size: int, *, rngs: nnx.Rngs,
                          precision: Precision) -> None:
  """Sets ``module.prefix_gru`` (GRU over [hidden_size] embeddings),
  ``embed_proj_in`` ([hidden_size + G] -> E) and ``embed_proj_out`` (E -> Vc).

  precision: the compute dtype throughout; these small matrices feed float32
  tree-building math, so no per-call weight casts.
  """
  module.prefix_gru = GRU(hidden_size, gru_hidden_dim, rngs=rngs, precision=precision)
  module.embed_proj_in = layers.linear(hidden_size + gru_hidden_dim, emb_dim, rngs=rngs,
                                       precision=precision)
  module.embed_proj_out = layers.linear(emb_dim, vocab_size, rngs=rngs, precision=precision)


@flax.struct.dataclass
class CorrectionHead:
  """The Domino head as float32 arrays, for one sequence or a batch.

  z: [..., D, E] ``W_z hid`` of each depth row (computed once per round);
  w_state: [G, E] ``W_s``; w_out: [E, Vc] (``W2`` transposed, over the base
  logits' columns: the target vocabulary, or a DART head's draft vocabulary);
  w_input: [H, 3G] and w_hidden: [G, 3G] the GRU kernels (gates r, z, n);
  embed: [V, H] the target's embedding (the GRU reads TARGET ids);
  num_uncorrected: depth rows < this use the base logits.
  """

  z: jax.Array
  w_state: jax.Array
  w_out: jax.Array
  w_input: jax.Array
  w_hidden: jax.Array
  embed: jax.Array
  num_uncorrected: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def state_size(self) -> int:
    return self.w_hidden.shape[0]

  def embed_rows(self, tokens: jax.Array) -> jax.Array:
    """Float32 embeddings of ``tokens [...]`` -> [..., H]."""
    return jnp.take(self.embed, tokens, axis=0).astype(jnp.float32)

  def gru(self, tokens: jax.Array, state: jax.Array) -> jax.Array:
    """GRU step on the embeddings of ``tokens [F]``; state [F, G] -> [F, G]."""
    return self.gru_on(self.embed_rows(tokens), state)

  def gru_on(self, x: jax.Array, state: jax.Array) -> jax.Array:
    """GRU step on embeddings ``x [F, H]`` (float32); state [F, G] -> [F, G]."""
    gi, gh = x @ self.w_input, state @ self.w_hidden
    g = self.state_size
    reset = jax.nn.sigmoid(gi[..., :g] + gh[..., :g])
    update = jax.nn.sigmoid(gi[..., g:2 * g] + gh[..., g:2 * g])
    candidate = jnp.tanh(gi[..., 2 * g:] + reset * gh[..., 2 * g:])
    return (1.0 - update) * candidate + update * state

  def root_state(self, root: jax.Array) -> jax.Array:
    """``s_0 = GRU(embed(root), 0)``: root [] -> [G]."""
    return self.gru(root[None], jnp.zeros((1, self.state_size), jnp.float32))[0]

  def bias(self, z: jax.Array, state: jax.Array, tokens: jax.Array) -> jax.Array:
    """Correction of logit columns ``tokens [K]`` under each state [F, G] -> [F, K]:
    ``W2[x] . SiLU(z + W_s s)`` with ``z [E]`` the depth's ``W_z hid`` row."""
    hidden = jax.nn.silu(z + state @ self.w_state)  # [F, E]
    return hidden @ jnp.take(self.w_out, tokens, axis=1)

  def full_bias(self, row: int, state: jax.Array) -> jax.Array:
    """The correction over all logit columns: state [G] -> [Vc]."""
    return jax.nn.silu(self.z[row] + state @ self.w_state) @ self.w_out


def correction_head_of(module, embed_table: jax.Array, hidden: jax.Array, *,
                       num_uncorrected: int = 0) -> CorrectionHead:
  """A ``CorrectionHead`` from a module's Domino parameters (shared by DFlash's
  Domino head and the DART-GRU correction).

  module: has ``prefix_gru`` (a ``GRU``), ``embed_proj_in`` (kernel [Hb+G, E],
  inputs: the drafter's hidden, then the GRU state) and ``embed_proj_out``
  (kernel [E, Vc]); embed_table: [V, H] the target's embedding; hidden:
  [..., D, Hb] the drafter's per-depth hidden (``W_z hid`` is computed here,
  once per round).
  """
  w1 = module.embed_proj_in.kernel[...].astype(jnp.float32)  # [Hb+G, E]
  size = hidden.shape[-1]
  z = jnp.einsum("...h,he->...e", hidden.astype(jnp.float32), w1[:size])
  return CorrectionHead(
      z=z, w_state=w1[size:],
      w_out=module.embed_proj_out.kernel[...].astype(jnp.float32),
      w_input=module.prefix_gru.input_kernel[...].astype(jnp.float32),
      w_hidden=module.prefix_gru.hidden_kernel[...].astype(jnp.float32),
      embed=embed_table, num_uncorrected=num_uncorrected)
