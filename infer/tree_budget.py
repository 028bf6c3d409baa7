"""Choosing DART's tree budget (``remain_total``) from measured costs.

A DART round verifies ``T = N + 1`` tokens (the root plus N draft nodes) in one
target pass and emits ``accept(N)`` tokens on average. Decoding speed is

    tokens / s  =  accept(N) / (verify_cost(N + 1) + overhead)

where ``overhead`` is the rest of a round (tree search, acceptance, the head's
drafting), roughly independent of N. On a TPU/GPU ``verify_cost`` is nearly flat
in T, so large trees win; on a CPU a 64-token pass costs several single-token
steps, so the best N is small. ``--tree-budget auto`` measures the pieces:

1. ``measure_verify_costs``: one compiled target forward per T in
   ``VERIFY_SIZES`` = 1, 2, 4, ..., 64 with a tree mask (a binary tree) against a
   cache of ``context_len`` committed tokens, timed as the median of ``reps``
   repetitions that visit the sizes in alternating order (forward, then
   backward), so that drift on a shared machine hits every size alike.
2. ``calibrate``: one short greedy DART run of the user's head on
   ``CALIBRATION_PROMPT`` (not a benchmark prompt) with the largest budget,
   ``N_max = 63``, gives the acceptance length ``L_max`` there; a second, shorter
   and already compiled run gives the seconds per round, and
   ``overhead = max(0, round_s - verify_cost(N_max + 1))``.
3. The acceptance model is a fixed concave prior pinned to that measurement:
   ``accept(N) = 1 + (L_max - 1) * log(1 + N) / log(1 + N_max)``, capped at the
   deepest possible path ``D + 1``. (Acceptance grows roughly logarithmically in
   the number of tree nodes: each extra node is a less likely candidate.)
4. ``choose_tree_budget`` picks the N (one of ``T - 1`` for the measured T)
   maximising the rate above; ties go to the smaller tree.

topk / beam_width: a tree of N nodes never holds more than N children of one
node or N beam members, so unless given they are ``min(25, N)`` and
``min(20, N)`` (the reference defaults, capped), which makes the search cheaper.
"""

import dataclasses
import math
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dart_jax.errors import InputError
from dart_jax.generate import attend_bucket
from dart_jax.tree import TreeConfig

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TOPK = 25
DEFAULT_BEAM_WIDTH = 20
CALIBRATION_PROMPT = ("Explain how a hash table works, then write a short Python "
                      "function that counts how often each word occurs in a text.")
CALIBRATION_TOKENS = 48
TIMING_TOKENS = 16


def _rate_table(cost_curve: Mapping[int, float], accept_curve, overhead_s: float
                ) -> dict[int, float]:
  """Expected tokens/s for each budget N = T - 1 >= 1 of ``cost_curve``."""
  accept = accept_curve if callable(accept_curve) else accept_curve.__getitem__
  rates = {}
  for size, cost in sorted(cost_curve.items()):
    budget = int(size) - 1
    if budget < 1:
      continue  # T = 1 is plain decoding: no draft node.
    seconds = float(cost) + overhead_s
    if not seconds > 0:
      raise InputError(f"verify cost for T={size} must be > 0, got {cost!r}")
    rates[budget] = float(accept(budget)) / seconds
  return rates


def expected_rates(cost_curve: Mapping[int, float],
                   accept_curve: Mapping[int, float] | Callable[[int], float],
                   overhead_s: float = 0.0) -> dict[int, float]:
  """Expected tokens/s per budget N (see the module docstring)."""
  return _rate_table(cost_curve, accept_curve, overhead_s)


def choose_tree_budget(cost_curve: Mapping[int, float],
                       accept_curve: Mapping[int, float] | Callable[[int], float],
                       overhead_s: float = 0.0) -> int:
  """The tree budget N maximising ``accept(N) / (cost(N + 1) + overhead_s)``.

  Args:
    cost_curve: verify seconds per pass of T tokens, ``{T: seconds}`` (T >= 2
      entries are candidates N = T - 1; a T = 1 entry is ignored).
    accept_curve: expected tokens emitted per round for N draft nodes, as a
      mapping ``{N: tokens}`` or a function of N.
    overhead_s: seconds per round besides verification.
  Returns:
    N (``TreeConfig.remain_total``); the smallest one among equal rates.
  """
  rates = _rate_table(cost_curve, accept_curve, overhead_s)
  if not rates:
    raise InputError("choose_tree_budget needs verify costs for at least one T >= 2")
  best = max(rates.values())
  return min(n for n, r in rates.items() if r >= best * (1 - 1e-12))


def log_prior_accept_curve(accept_at_max: float, max_budget: int, max_depth: int
                           ) -> Callable[[int], float]:
  """``N -> 1 + (L_max - 1) * log(1 + N) / log(1 + N_max)``, capped at ``max_depth``.

  accept_at_max: measured acceptance length L_max with ``max_budget`` nodes;
  max_depth: the longest emittable path per round (D + 1).
  """
  gain = max(float(accept_at_max) - 1.0, 0.0)

  def accept(budget: int) -> float:
    value = 1.0 + gain * math.log1p(budget) / math.log1p(max_budget)
    return min(value, float(max_depth))

  return accept


def tree_config_for(budget: int, topk: int | None = None,
                    beam_width: int | None = None) -> TreeConfig:
  """A ``TreeConfig`` with ``remain_total=budget``; topk/beam capped at the budget
  unless given (more would not change which N nodes are kept)."""
  return TreeConfig(topk=topk or min(DEFAULT_TOPK, budget),
                    beam_width=beam_width or min(DEFAULT_BEAM_WIDTH, budget),
                    remain_total=budget)


def binary_tree_mask(size: int) -> tuple[np.ndarray, np.ndarray]:
  """Ancestor mask [T, T] and depths [T] of a binary tree in BFS order (node i's
  parent is (i - 1) // 2): a stand-in tree shape for timing."""
  depth = np.zeros(size, np.int32)
  mask = np.eye(size, dtype=bool)
  for i in range(1, size):
    parent = (i - 1) // 2
    depth[i] = depth[parent] + 1
    mask[i] |= mask[parent]
  return mask, depth


def measure_verify_costs(target, sizes=VERIFY_SIZES, *, context_len: int = 192,
                         reps: int = 7, taps: tuple[int, ...] | None = None
                         ) -> dict[int, float]:
  """Median seconds of one target tree-verify pass of T tokens, per T in ``sizes``.

  Each pass reads ``context_len`` committed cache rows (the attention window is
  rounded up as ``generate`` rounds it), computes logits for all T rows and the
  DART taps, like a verification round.
  """
  taps = tuple(target.config.dart_tap_layers if taps is None else taps)
  largest = max(sizes)
  capacity = -(-(context_len + largest + 1) // 256) * 256
  attend_len = attend_bucket(context_len + 1, capacity)
  cache = target.new_cache(1, capacity)
  cache = cache.replace(lengths=jnp.full((1,), context_len, jnp.int32))
  rng = np.random.default_rng(0)
  inputs = {}
  for size in sizes:
    mask, depth = binary_tree_mask(size)
    tokens = rng.integers(0, target.config.vocab_size, (1, size)).astype(np.int32)
    inputs[size] = (jnp.asarray(tokens), jnp.asarray(context_len + depth[None]),
                    jnp.asarray(mask[None]))

  def run(size):
    nonlocal cache
    tokens, positions, mask = inputs[size]
    start = time.perf_counter()
    out = target.forward(tokens, positions, cache, mask, attend_len=attend_len, taps=taps)
    jax.block_until_ready(out.logits)
    elapsed = time.perf_counter() - start
    cache = out.cache  # The input cache was donated; keep using the returned one.
    return elapsed

  for size in sizes:  # Compile every size first.
    run(size)
  times = {size: [] for size in sizes}
  for rep in range(reps):
    for size in (sizes if rep % 2 == 0 else tuple(reversed(sizes))):
      times[size].append(run(size))
  return {size: float(np.median(t)) for size, t in times.items()}


@dataclasses.dataclass
class BudgetChoice:
  """What ``auto_tree_budget`` measured and chose (all times in seconds)."""

  budget: int
  tree: TreeConfig
  verify_costs: dict[int, float]
  accept_at_max: float
  max_budget: int
  round_s_at_max: float
  overhead_s: float
  expected_tokens_per_s: dict[int, float]
  ar_tokens_per_s: float  # 1 / verify_cost(1): the model's plain-decoding estimate

  def to_json(self) -> dict:
    return {
        "budget": self.budget, "topk": self.tree.topk,
        "beam_width": self.tree.beam_width,
        "verify_ms": {str(t): c * 1e3 for t, c in self.verify_costs.items()},
        "accept_at_max": self.accept_at_max, "max_budget": self.max_budget,
        "round_ms_at_max": self.round_s_at_max * 1e3,
        "overhead_ms": self.overhead_s * 1e3,
        "expected_tokens_per_s": {str(n): r for n, r in self.expected_tokens_per_s.items()},
        "ar_tokens_per_s_estimate": self.ar_tokens_per_s,
        "model": "accept(N) = 1 + (L_max-1) log(1+N)/log(1+N_max), capped at D+1; "
                 "rate = accept(N) / (verify(N+1) + overhead)",
    }


def calibrate(target, head, ngram, tree: TreeConfig, *, prompt: str = CALIBRATION_PROMPT,
              seed: int = 0) -> tuple[float, float]:
  """Greedy DART on ``prompt`` with ``tree`` -> (acceptance length, seconds per round).

  The first run (which compiles) gives the acceptance length; a shorter second run,
  compiled by then, gives the round time.
  """
  import dart_jax as dj  # Local: keeps this module importable without loading models.

  # Without a tokenizer (random test targets) a fixed run of token ids stands in.
  prompt_arg = prompt if target.tokenizer is not None else [
      i % target.config.vocab_size for i in range(1, 33)]
  kwargs = dict(draft=head, ngram=ngram, tree=tree, temperature=0.0, seed=seed)
  first = dj.generate(target, prompt_arg, max_new_tokens=CALIBRATION_TOKENS, **kwargs)
  timed = dj.generate(target, prompt_arg, max_new_tokens=TIMING_TOKENS, **kwargs)
  s = timed.stats
  decode_s = s.total_s - s.time_to_first_token_s
  round_s = decode_s / s.rounds if s.rounds else float("nan")
  return first.stats.mean_accept_len, round_s


def auto_tree_budget(target, head, ngram=None, *, topk: int | None = None,
                     beam_width: int | None = None, sizes=VERIFY_SIZES,
                     context_len: int = 192, reps: int = 7, log=print) -> BudgetChoice:
  """Measures verify costs and a calibration run, then picks the budget."""
  log(f"[tree-budget] timing target verify passes for T in {tuple(sizes)} ...")
  costs = measure_verify_costs(target, sizes, context_len=context_len, reps=reps)
  log("[tree-budget] verify ms: " + ", ".join(f"T={t}: {c * 1e3:.1f}"
                                               for t, c in costs.items()))
  max_budget = max(sizes) - 1
  big_tree = tree_config_for(max_budget, topk, beam_width)
  log(f"[tree-budget] calibration run with remain_total={max_budget} ...")
  accept_at_max, round_s = calibrate(target, head, ngram, big_tree)
  overhead = max(0.0, round_s - costs[max(sizes)])
  accept = log_prior_accept_curve(accept_at_max, max_budget, head.config.draft_length + 1)
  budget = choose_tree_budget(costs, accept, overhead)
  rates = expected_rates(costs, accept, overhead)
  choice = BudgetChoice(budget, tree_config_for(budget, topk, beam_width), costs,
                        accept_at_max, max_budget, round_s, overhead, rates,
                        1.0 / costs[min(sizes)] if min(sizes) == 1 else float("nan"))
  log(f"[tree-budget] L_max={accept_at_max:.2f} at N={max_budget}, overhead "
      f"{overhead * 1e3:.1f} ms/round -> remain_total={budget} (topk {choice.tree.topk}, "
      f"beam {choice.tree.beam_width}); expected {rates[budget]:.1f} tok/s")
  return choice
