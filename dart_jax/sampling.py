"""Logits processing (temperature, top-p, top-k) and token sampling.

The same processed distribution is used by plain decoding and by speculative
verification, so both sample from exactly one target distribution.
"""

import dataclasses

import jax
import jax.numpy as jnp

from dart_jax.errors import InputError


class KeySequence:
  """The PRNG keys of one decoding call, one per use, from a seed (so that a
  call is reproducible)."""

  def __init__(self, seed: int):
    self._key = jax.random.PRNGKey(seed)

  def next(self) -> jax.Array:
    self._key, sub = jax.random.split(self._key)
    return sub


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
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
    # strictly before it is below top_p (the most likely token always stays).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    kept = mass_before < config.top_p
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  if config.top_k > 0 and config.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def sample(key: jax.Array, logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """One token per row. logits: [..., V] -> [...] int32."""
  if config.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, processed_log_probs(logits, config)).astype(jnp.int32)
