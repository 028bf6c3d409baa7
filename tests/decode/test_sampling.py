"""Drawing tokens: the two-level inverse-CDF draw has the distribution it is given."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dart_jax import sampling
from dart_jax.models import precision
from dart_jax.sampling import _invert, sample_log_probs

VOCAB = 1000  # 8 blocks of 128, the last one partial


def _distribution(seed: int = 0) -> np.ndarray:
  """A peaked distribution over VOCAB with a third of the tokens excluded."""
  rng = np.random.default_rng(seed)
  logits = 2.0 * rng.normal(size=VOCAB)
  logits[rng.random(VOCAB) < 1 / 3] = -np.inf
  probs = np.exp(logits - logits[np.isfinite(logits)].max())
  return probs / probs.sum()


def _draw_counts(probs: np.ndarray, calls: int = 20, rows: int = 10000) -> np.ndarray:
  log_probs = jnp.log(jnp.asarray(probs, jnp.float32))
  draw = jax.jit(lambda key: sample_log_probs(key, jnp.broadcast_to(log_probs,
                                                                     (rows, VOCAB))))
  counts = np.zeros(VOCAB)
  for key in jax.random.split(jax.random.PRNGKey(0), calls):
    counts += np.bincount(np.asarray(draw(key)), minlength=VOCAB)
  return counts


def _p_value(counts: np.ndarray, probs: np.ndarray) -> float:
  total = counts.sum()
  keep = probs * total >= 5
  observed = np.append(counts[keep], counts[~keep].sum())
  expected = np.append(probs[keep], probs[~keep].sum()) * total
  return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_draws_follow_the_distribution_and_never_an_excluded_token():
  probs = _distribution()
  counts = _draw_counts(probs)
  assert counts[probs == 0].sum() == 0
  assert _p_value(counts, probs) > 1e-3
  # Power: the same test rejects 2% of the mass moved onto the likeliest token.
  biased = 0.98 * probs
  biased[np.argmax(probs)] += 0.02
  rng = np.random.default_rng(1)
  rejected = [_p_value(rng.multinomial(int(counts.sum()), biased).astype(float), probs)
              < 1e-3 for _ in range(20)]
  assert np.mean(rejected) >= 0.9


def test_inversion_never_lands_on_a_zero_weight():
  weights = jnp.asarray([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0]])
  largest_below_one = jnp.asarray([np.nextafter(np.float32(1), np.float32(0))])
  assert int(_invert(weights, largest_below_one)[0]) == 3
  assert int(_invert(weights, jnp.asarray([0.0]))[0]) == 1
  assert int(_invert(weights, jnp.asarray([0.7]))[0]) == 3
  assert int(_invert(weights, jnp.asarray([0.6]))[0]) == 1


def test_greedy_tokens_is_the_first_argmax_including_ties():
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((4, 7, 300)).astype(np.float32)
  logits[0, 0, [5, 17, 200]] = 9.0  # A three-way tie: the first index wins.
  logits[1, 2, -1] = 50.0
  logits[2, 3] = -np.inf
  logits[2, 3, 42] = 0.0
  logits[3, 4] = -np.inf  # every index ties: the first
  for kernel in (True, False):  # the CPU kernel's scan where built, and XLA's form
    with precision.cpu_kernel(kernel):
      got = np.asarray(jax.jit(sampling.greedy_tokens)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got[0, 0] == 5
    assert got.dtype == np.int32


def test_key_sequence_is_the_split_chain_across_blocks():
  """Keys made a block at a time equal ``key, sub = split(key)`` one by one."""
  keys = sampling.KeySequence(7)
  key = jax.random.PRNGKey(7)
  for _ in range(2 * sampling.KEY_BLOCK + 3):
    key, sub = jax.random.split(key)
    assert np.array_equal(keys.next(), np.asarray(sub))
