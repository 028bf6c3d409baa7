"""Logits processing (temperature, top-p, top-k) and token sampling.

The same processed distribution is used by plain decoding and by speculative
verification, so both sample from exactly one target distribution.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dart_jax.errors import InputError
from dart_jax.models import precision
from kernels import cpu_matmul


KEY_BLOCK = 64  # keys made per device call


@functools.partial(jax.jit, static_argnums=1)
def _split_chain(key: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """``count`` times ``key, sub = split(key)`` -> (the last key, subs [count, 2])."""
  def split_once(carry, _):
    carry, sub = jax.random.split(carry)
    return carry, sub
  return jax.lax.scan(split_once, key, None, length=count)


class KeySequence:
  """The PRNG keys of one decoding call, one per use, from a seed (so that a
  call is reproducible): the chain ``key, sub = split(key)``.

  The keys are made ``KEY_BLOCK`` at a time and handed out as host arrays: a
  split per round is a device call of its own (~0.5 ms of host time, in a
  decode step of ~12 ms on the 2-core CPU).
  """

  def __init__(self, seed: int):
    self._key = jax.random.PRNGKey(seed)
    self._block = np.zeros((0, 2), np.uint32)
    self._used = 0

  def next(self) -> np.ndarray:
    """The next key: uint32 [2], the same as one more ``split`` of the chain."""
    if self._used == len(self._block):
      self._key, block = _split_chain(self._key, KEY_BLOCK)
      self._block, self._used = np.asarray(block), 0
    self._used += 1
    return self._block[self._used - 1]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 = greedy; top_p in (0, 1]; top_k 0 = off."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if not self.temperature >= 0.0:
      raise InputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or int(self.top_k) != self.top_k:
      raise InputError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def processed_log_probs(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """Log-probabilities after temperature, then top-p, then top-k (-inf = removed).

  logits: [..., V] -> [..., V] float32. Not for greedy configs.
  """
  logits = logits.astype(jnp.float32) / config.temperature
  if config.top_p < 1.0:
    logits = jnp.where(logits >= top_p_threshold(logits, config.top_p), logits, -jnp.inf)
  if config.top_k > 0 and config.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def top_p_threshold(logits: jax.Array, top_p: float) -> jax.Array:
  """The smallest logit the nucleus keeps: [..., V] -> [..., 1] float32.

  Keep the smallest prefix of the logits, largest first, whose mass reaches
  top_p: a token stays if the mass strictly before it is below top_p (the most
  likely token always stays). Where the CPU kernels run, their scan (which
  orders only the top logits; 6 rows of 49152 in ~2 ms instead of XLA:CPU's
  85 ms full sort); elsewhere a sort.
  """
  if logits.dtype == jnp.float32 and precision.cpu_kernel_active():
    return cpu_matmul.top_p_threshold(logits, top_p)
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  kept = mass_before < top_p
  return jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)


def sample(key: jax.Array, logits: jax.Array, config: SamplingConfig,
           rows: jax.Array | None = None, num_rows: int = 0) -> jax.Array:
  """One token per row. logits: [..., V] -> [...] int32.

  rows, num_rows: ``sample_log_probs``'s, for a batch that is a subset of a
  larger one.
  """
  if config.greedy:
    return greedy_tokens(logits)
  return sample_log_probs(key, processed_log_probs(logits, config), rows, num_rows)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """``argmax(logits, -1)`` (the first maximal index) -> [...] int32.

  Where the CPU kernels run (``precision.cpu_kernel_active``), float32 logits
  go through ``kernels.cpu_matmul.rows_argmax``: XLA:CPU's reductions take
  0.5-0.9 ms for the 6 x 49152 logits of a verified tree on the 2-core Zen 3,
  the kernel's scan tens of microseconds. Elsewhere: a max, then the smallest
  index holding it, two plain reductions that XLA:CPU vectorises where
  ``jnp.argmax``'s (value, index) reduction does not (9 x 49152 logits: 0.37
  vs 0.77 ms). NaNs: the kernel skips them; the XLA form gives the last index
  for a row holding one.
  """
  if logits.dtype == jnp.float32 and precision.cpu_kernel_active():
    return cpu_matmul.rows_argmax(logits)
  vocab = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  first = jnp.min(jnp.where(logits == top, index, vocab), axis=-1)
  return jnp.minimum(first, vocab - 1).astype(jnp.int32)


_BLOCK = 128  # tokens per block of the two-level draw


def sample_log_probs(key: jax.Array, log_probs: jax.Array, rows: jax.Array | None = None,
                     num_rows: int = 0) -> jax.Array:
  """One draw per row from ``log_probs [..., V]`` (-inf = excluded) -> [...] int32.

  Inverts the distribution function in two levels: a block of 128 tokens by the
  blocks' masses, then a token within it, each from one uniform. Two uniforms per
  row instead of V Gumbel draws (``jax.random.categorical``): for a verified tree of
  9 nodes over 49152 tokens 0.75 ms instead of 6.3 on a 2-core CPU. Two short
  prefix sums keep float32 rounding small: a token's probability is off by at most
  about 128 + V/128 float32 ulps of its block's or the total mass (Gumbel-max in
  float32 never draws tokens below ~1e-8 of the top one at all).

  rows: [B] with ``num_rows`` (static): ``log_probs``' leading axis holds rows
  ``rows`` of a batch of ``num_rows``; each row then gets exactly the uniforms
  it would get in that whole batch, so dropping finished rows from a batch
  changes no draw.
  """
  lead, vocab = log_probs.shape[:-1], log_probs.shape[-1]
  blocks = -(-vocab // _BLOCK)
  weights = jnp.exp(log_probs - jnp.max(log_probs, axis=-1, keepdims=True))
  weights = jnp.pad(weights, [(0, 0)] * len(lead) + [(0, blocks * _BLOCK - vocab)])
  weights = weights.reshape(*lead, blocks, _BLOCK)
  if rows is None:
    u_block, u_token = jax.random.uniform(key, (2,) + lead)
  else:
    u_block, u_token = jax.random.uniform(key, (2, num_rows) + lead[1:])[:, rows]
  block = _invert(jnp.sum(weights, axis=-1), u_block)
  within = jnp.take_along_axis(weights, block[..., None, None], axis=-2)[..., 0, :]
  return (block * _BLOCK + _invert(within, u_token)).astype(jnp.int32)


def _invert(weights: jax.Array, u: jax.Array) -> jax.Array:
  """The index i with cdf(i-1) <= u * total < cdf(i): weights [..., n] >= 0 (some
  > 0), u [...] in [0, 1) -> [...] int32; never a zero-weight index."""
  cdf = jnp.cumsum(weights, axis=-1)
  index = jnp.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)
  # u * total can round up to the total: fall back to the last positive weight.
  last = weights.shape[-1] - 1 - jnp.argmax(weights[..., ::-1] > 0, axis=-1)
  return jnp.minimum(index, last).astype(jnp.int32)
