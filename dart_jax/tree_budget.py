"""Choosing the tree budget of a speculative method from measured costs.

A round verifies ``T = N + 1`` tokens (the root plus N draft nodes) in one
target pass and emits ``accept(N)`` tokens on average. Decoding speed is

    tokens / s  =  accept(N) / (verify_cost(N + 1) + overhead)

where ``overhead`` is the rest of a round (tree search, acceptance, the
drafter's pass), roughly independent of N. On a TPU/GPU ``verify_cost`` is
nearly flat in T, so large trees win; on a CPU a 64-token pass costs several
single-token steps, so the best N is small. ``choose_budget`` measures the
pieces for one method family (``TreeFamily``):

1. ``measure_verify_costs``: one compiled target forward per T (by default T in
   ``VERIFY_SIZES`` = 1, 2, 4, ..., 64) with a tree mask (a binary tree)
   against a cache of ``context_len`` committed tokens, timed as the median of
   ``reps`` repetitions that visit the sizes in alternating order (forward,
   then backward), so that drift on a shared machine hits every size alike.
2. ``calibrate``: a short greedy run of the user's drafter on
   each of ``CALIBRATION_PROMPTS`` (not benchmark prompts) with the largest
   candidate tree, ``N_max`` nodes, gives the acceptance length ``L_max`` there
   (tokens over rounds, all prompts together); a second, shorter and already
   compiled run of the first prompt gives the seconds per round, and
   ``overhead = max(0, round_s - verify_cost(N_max + 1))``. When ``N_max >= 15``
   a second tree is calibrated the same way: the candidate nearest the middle of
   ``log(1 + N)`` between 0 and ``N_max`` (7 nodes when ``N_max`` is 63), see
   ``calibration_nodes``.
3. The acceptance model (``accept_curve``) is piecewise linear in
   ``log(1 + N)`` through ``(0, 1)`` and the calibrated points (so with one
   point, ``accept(N) = 1 + (L_max - 1) * log(1 + N) / log(1 + N_max)``),
   capped at the longest path a round can emit (D + 1) and at N + 1.
   Acceptance grows roughly logarithmically in the number of tree nodes (each
   extra node is a less likely candidate), but for a trained head it is more
   concave than that: the first few nodes hold most of it. One point at 63
   nodes predicted 1.74 tokens per round at 7 nodes for the shipped SmolLM2
   head, which accepts 2.4-2.7 there, and chose 3 nodes on a CPU; the second
   point pins the small trees that a CPU chooses between. The overhead is
   interpolated between the points the same way (constant outside them).
4. ``choose_tree_budget`` picks the N maximising the rate above; ties go to
   the smaller tree.

Candidates. The budgets tried are ``T - 1`` for the T >= 2 of ``sizes``; a
family maps a budget to the draft nodes its trees really hold
(``TreeFamily.nodes_for``), and the candidates are those node counts (each
reached by its smallest budget), so verify costs are measured at the real
``nodes + 1``. The families:

- DART (``auto_tree_budget``, ``--tree-budget auto``): the budget is
  ``TreeConfig.remain_total`` = nodes. topk / beam_width: a tree of N nodes
  never holds more than N children of one node or N beam members, so unless
  given they are ``min(25, N)`` and ``min(20, N)`` (the reference defaults,
  capped), which makes the search cheaper. Longest path D + 1 (D the head's
  draft length); verify taps DART's layers.
- DARTree (``auto_dartree_budget``, ``--dartree-budget auto``): the budget is
  ``DARTreeConfig.budget`` (B_tree), the other fields the user's. Nodes =
  ``dart_jax.tree.dartree.num_tree_nodes``: "dartree" (pruned) keeps
  ``min(B, sum of its supertree widths)`` (at most D x supertree_width), and
  "ddtree" ``min(B, sum_d min(B, K^d))``, so budgets past the largest tree
  collapse onto it; "dartree-fixed" builds ``ceil(remaining / remaining
  depths)`` pairs per depth, each capped at frontier x K (``level_widths``),
  so it holds exactly B nodes unless a cap bites (then fewer, e.g. D = 2,
  K = 2: B = 7 builds 2 + 4 = 6). Chains have no budget. Drafters: DFlash /
  Domino (D = block_size - 1 depths, longest path block_size, taps
  ``config.taps``) and DART-GRU (D + 1 levels, longest path D + 2, DART's taps;
  the tree is built over its draft vocabulary).
"""

import dataclasses
import math
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dart_jax.decode.methods import method_for
from dart_jax.errors import InputError
from dart_jax.generate import attend_bucket, generate
from dart_jax.tree import TreeConfig
from dart_jax.tree.dartree import num_tree_nodes

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TOPK = 25
DEFAULT_BEAM_WIDTH = 20
# Three kinds of request (explanation with code, code alone, prose), none from a
# benchmark: one prompt's acceptance over 48 tokens varied too much to size a tree.
CALIBRATION_PROMPTS = (
    "Explain how a hash table works, then write a short Python function that counts "
    "how often each word occurs in a text.",
    "Write a C function that reverses a singly linked list in place, with comments.",
    "Write a short letter to a neighbour asking them to water the plants while you "
    "are away for a week.",
)
CALIBRATION_TOKENS = 48
TIMING_TOKENS = 16


def _rate_table(cost_curve: Mapping[int, float], accept_curve,
                overhead_s: float | Callable[[int], float]) -> dict[int, float]:
  """Expected tokens/s for each budget N = T - 1 >= 1 of ``cost_curve``."""
  accept = accept_curve if callable(accept_curve) else accept_curve.__getitem__
  overhead = overhead_s if callable(overhead_s) else lambda budget: overhead_s
  rates = {}
  for size, cost in sorted(cost_curve.items()):
    budget = int(size) - 1
    if budget < 1:
      continue  # T = 1 is plain decoding: no draft node.
    seconds = float(cost) + float(overhead(budget))
    if not seconds > 0:
      raise InputError(f"verify cost for T={size} must be > 0, got {cost!r}")
    rates[budget] = float(accept(budget)) / seconds
  return rates


def expected_rates(cost_curve: Mapping[int, float],
                   accept_curve: Mapping[int, float] | Callable[[int], float],
                   overhead_s: float | Callable[[int], float] = 0.0) -> dict[int, float]:
  """Expected tokens/s per budget N (see the module docstring)."""
  return _rate_table(cost_curve, accept_curve, overhead_s)


def choose_tree_budget(cost_curve: Mapping[int, float],
                       accept_curve: Mapping[int, float] | Callable[[int], float],
                       overhead_s: float | Callable[[int], float] = 0.0) -> int:
  """The tree budget N maximising ``accept(N) / (cost(N + 1) + overhead_s)``.

  Args:
    cost_curve: verify seconds per pass of T tokens, ``{T: seconds}`` (T >= 2
      entries are candidates N = T - 1; a T = 1 entry is ignored).
    accept_curve: expected tokens emitted per round for N draft nodes, as a
      mapping ``{N: tokens}`` or a function of N.
    overhead_s: seconds per round besides verification (a number, or a
      function of N).
  Returns:
    N (``TreeConfig.remain_total``); the smallest one among equal rates.
  """
  rates = _rate_table(cost_curve, accept_curve, overhead_s)
  if not rates:
    raise InputError("choose_tree_budget needs verify costs for at least one T >= 2")
  best = max(rates.values())
  return min(n for n, r in rates.items() if r >= best * (1 - 1e-12))


def _interp_log1p(points: Mapping[int, float], nodes: int) -> float:
  """Linear in ``log(1 + nodes)`` between ``points`` ({nodes: value}), constant
  outside them."""
  xs = sorted(points)
  return float(np.interp(math.log1p(nodes), [math.log1p(x) for x in xs],
                         [points[x] for x in xs]))


def accept_curve(calibrated: Mapping[int, float], max_depth: int
                 ) -> Callable[[int], float]:
  """The acceptance model: ``N -> `` piecewise linear in ``log(1 + N)`` through
  ``(0, 1)`` and the ``calibrated`` points ``{nodes: acceptance length}``, made
  non-decreasing in N, constant past the largest point, capped at ``max_depth``
  (the longest emittable path per round, D + 1) and at ``N + 1`` (N nodes hold
  no path longer than N, plus the bonus token). With one point (N_max, L_max):
  ``1 + (L_max - 1) * log(1 + N) / log(1 + N_max)``.
  """
  points, floor = {0: 1.0}, 1.0
  for nodes in sorted(calibrated):
    floor = max(floor, float(calibrated[nodes]))
    points[int(nodes)] = floor

  def accept(budget: int) -> float:
    return min(_interp_log1p(points, budget), float(max_depth), budget + 1.0)

  return accept


def calibration_nodes(candidates) -> tuple[int, ...]:
  """The candidate node counts a choice calibrates, largest first: the largest,
  and when it is >= 15 also the candidate of >= 3 nodes nearest the middle of
  ``log(1 + N)`` between 0 and it (7 of 1, 3, 7, 15, 31, 63)."""
  largest = max(candidates)
  small = [n for n in candidates if 3 <= n < largest]
  if largest < 15 or not small:
    return (largest,)
  middle = math.log1p(largest) / 2
  return largest, min(small, key=lambda n: (abs(math.log1p(n) - middle), n))


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
  ``taps`` (default: the target's DART tap layers), like a verification round.
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


_ACCEPT_MODEL = ("accept(N) piecewise linear in log(1+N) through (0, 1) and the "
                 "calibrated (nodes, acceptance) points, capped at {cap} and N+1; "
                 "overhead(N) = round - verify(nodes+1) at the calibrated points, "
                 "interpolated likewise; rate = accept(N) / (verify(N+1) + overhead(N))")
DART_MODEL = _ACCEPT_MODEL.format(cap="D+1")
DARTREE_MODEL = ("N = draft nodes the budget builds; "
                 + _ACCEPT_MODEL.format(cap="the longest path"))


@dataclasses.dataclass
class BudgetChoice:
  """What ``choose_budget`` measured and chose (all times in seconds).

  budget: the chosen budget; tree: the tree option built with it (a DART
  ``TreeConfig`` or a ``DARTreeConfig``); max_budget: the largest calibration
  tree's budget (accept_at_max, round_s_at_max: measured with it); overhead_s:
  the model's overhead at the chosen budget; expected_tokens_per_s: {budget:
  tokens/s} per candidate; tree_fields: the tree's other settings, for the
  JSON; nodes: {budget: draft nodes} per candidate where nodes can differ from
  the budget (DARTree), else None; calibration: {budget: (acceptance, seconds
  per round)} of every calibrated tree (``calibration_nodes``).
  """

  budget: int
  tree: Any
  verify_costs: dict[int, float]
  accept_at_max: float
  max_budget: int
  round_s_at_max: float
  overhead_s: float
  expected_tokens_per_s: dict[int, float]
  ar_tokens_per_s: float  # 1 / verify_cost(1): the model's plain-decoding estimate
  tree_fields: dict = dataclasses.field(default_factory=dict)
  nodes: dict[int, int] | None = None
  model: str = DART_MODEL
  calibration: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    out = {"budget": self.budget, **self.tree_fields}
    if self.nodes is not None:
      out.update(nodes=self.nodes[self.budget], max_nodes=self.nodes[self.max_budget],
                 nodes_per_budget={str(b): n for b, n in self.nodes.items()})
    out.update({
        "verify_ms": {str(t): c * 1e3 for t, c in self.verify_costs.items()},
        "accept_at_max": self.accept_at_max, "max_budget": self.max_budget,
        "round_ms_at_max": self.round_s_at_max * 1e3,
        "overhead_ms": self.overhead_s * 1e3,
        "calibration": {str(b): {"accept": a, "round_ms": r * 1e3}
                        for b, (a, r) in self.calibration.items()},
        "expected_tokens_per_s": {str(n): r for n, r in self.expected_tokens_per_s.items()},
        "ar_tokens_per_s_estimate": self.ar_tokens_per_s,
        "model": self.model,
    })
    return out


@dataclasses.dataclass(frozen=True)
class TreeFamily:
  """What the budget choice needs to know about one method (``dart_family``,
  ``dartree_family``); the measurement, the prior and the choice are shared.

  tree_for: budget -> the tree option ``generate`` takes (also recorded).
  generate_kwargs: tree option -> ``generate``'s method keyword arguments
    (``draft=``, ``tree=``, ...), for the calibration runs.
  max_path: the most tokens one round can emit (the deepest path + the bonus).
  nodes_for: budget -> draft nodes per round of the trees it builds.
  taps: target layers the verify pass taps (None: the target's DART taps).
  budget_name: what the budget is called in the log.
  describe: tree option -> its other settings, for the log.
  tree_json: tree option -> its other settings, for ``BudgetChoice.to_json``.
  log_prefix: starts every log line.
  model: the model's description in the JSON.
  reports_nodes: record the node count per budget (where it can differ).
  """

  tree_for: Callable[[int], Any]
  generate_kwargs: Callable[[Any], dict]
  max_path: int
  nodes_for: Callable[[int], int] = lambda budget: budget
  taps: tuple[int, ...] | None = None
  budget_name: str = "budget"
  describe: Callable[[Any], str] = str
  tree_json: Callable[[Any], dict] = lambda tree: {}
  log_prefix: str = "[tree-budget]"
  model: str = DART_MODEL
  reports_nodes: bool = False


def calibrate(target, method_kwargs: dict, *, prompts=CALIBRATION_PROMPTS,
              seed: int = 0) -> tuple[float, float]:
  """Greedy decoding of ``prompts`` with ``generate(**method_kwargs)`` ->
  (acceptance length, seconds per round).

  The acceptance length is the tokens emitted over the rounds run, all prompts
  together (the first run compiles); a shorter second run of the first prompt,
  compiled by then, gives the round time.
  """
  # Without a tokenizer (random test targets) fixed runs of token ids stand in.
  if target.tokenizer is None:
    prompts = [[(i * (k + 1)) % target.config.vocab_size or 1 for i in range(1, 33)]
               for k in range(len(prompts))]
  kwargs = dict(method_kwargs, temperature=0.0, seed=seed)
  tokens = rounds = 0
  for prompt in prompts:
    stats = generate(target, prompt, max_new_tokens=CALIBRATION_TOKENS, **kwargs).stats
    tokens += stats.mean_accept_len * stats.rounds
    rounds += stats.rounds
  timed = generate(target, prompts[0], max_new_tokens=TIMING_TOKENS, **kwargs)
  s = timed.stats
  decode_s = s.total_s - s.time_to_first_token_s
  round_s = decode_s / s.rounds if s.rounds else float("nan")
  return (tokens / rounds if rounds else float("nan")), round_s


def candidate_budgets(family: TreeFamily, sizes=VERIFY_SIZES) -> dict[int, int]:
  """{draft nodes: the smallest budget building them} for the budgets ``T - 1``
  of the T >= 2 in ``sizes``, in increasing order."""
  by_nodes: dict[int, int] = {}
  for budget in sorted({int(t) - 1 for t in sizes if int(t) >= 2}):
    by_nodes.setdefault(int(family.nodes_for(budget)), budget)
  if not by_nodes:
    raise InputError(f"the tree budget needs a verify size T >= 2 among {tuple(sizes)}")
  return dict(sorted(by_nodes.items()))


def verify_sizes(family: TreeFamily, sizes=VERIFY_SIZES) -> tuple[int, ...]:
  """The verify sizes T a choice for ``family`` needs: ``nodes + 1`` per candidate,
  and 1 (plain decoding, for the estimate of its speed) if ``sizes`` holds it."""
  nodes = candidate_budgets(family, sizes)
  return tuple(sorted(({1} & {int(t) for t in sizes}) | {n + 1 for n in nodes}))


def pick_budget(verify_costs: Mapping[int, float], by_nodes: Mapping[int, int],
                calibration: Mapping[int, tuple[float, float]], max_path: int
                ) -> tuple[int, float, dict[int, float]]:
  """The choice from measured numbers -> (budget, overhead_s at it, {budget: tokens/s}).

  verify_costs: {T: seconds}, holding ``nodes + 1`` for every candidate;
  by_nodes: {draft nodes: budget} (``candidate_budgets``); calibration:
  {draft nodes: (acceptance length, seconds per round)} of the calibrated trees
  (``calibration_nodes``); max_path: the longest path.
  """
  accept = accept_curve({n: a for n, (a, _) in calibration.items()}, max_path)
  overheads = {n: max(0.0, round_s - verify_costs[n + 1])
               for n, (_, round_s) in calibration.items()}
  overhead = lambda nodes: _interp_log1p(overheads, nodes)
  node_costs = {n + 1: verify_costs[n + 1] for n in by_nodes}
  nodes = choose_tree_budget(node_costs, accept, overhead)
  rates = expected_rates(node_costs, accept, overhead)
  return by_nodes[nodes], overhead(nodes), {by_nodes[n]: r for n, r in rates.items()}


def choose_budget(target, family: TreeFamily, *, sizes=VERIFY_SIZES,
                  context_len: int = 192, reps: int = 7,
                  verify_costs: dict[int, float] | None = None, log=print) -> BudgetChoice:
  """Measures verify costs and the calibration runs, then picks the budget.

  verify_costs: measured ``{T: seconds}`` of this target to reuse, e.g. one
  curve timed for several methods (``verify_sizes`` says which T each needs).
  If it lacks one of them, all the sizes this choice needs are timed again in
  one pass (sizes timed at different moments of a busy machine do not compare)
  and written into it.
  """
  p = family.log_prefix
  by_nodes = candidate_budgets(family, sizes)
  wanted = verify_sizes(family, sizes)
  if verify_costs is not None and all(t in verify_costs for t in wanted):
    costs = {t: verify_costs[t] for t in wanted}
  else:
    log(f"{p} timing target verify passes for T in {wanted} ...")
    costs = measure_verify_costs(target, wanted, context_len=context_len, reps=reps,
                                 taps=family.taps)
    if verify_costs is not None:
      verify_costs.update(costs)
  log(f"{p} verify ms: " + ", ".join(f"T={t}: {c * 1e3:.1f}" for t, c in costs.items()))
  calibration = {}  # {nodes: (acceptance, seconds per round)}
  for nodes in calibration_nodes(by_nodes):
    tree = family.tree_for(by_nodes[nodes])
    log(f"{p} calibration run with {family.budget_name}={by_nodes[nodes]} "
        f"({family.describe(tree)}) ...")
    calibration[nodes] = calibrate(target, family.generate_kwargs(tree))
  budget, overhead, rates = pick_budget(costs, by_nodes, calibration, family.max_path)
  tree = family.tree_for(budget)
  max_nodes = max(by_nodes)
  max_budget = by_nodes[max_nodes]
  accept_at_max, round_s = calibration[max_nodes]
  choice = BudgetChoice(
      budget, tree, costs, accept_at_max, max_budget, round_s, overhead, rates,
      1.0 / costs[1] if 1 in costs else float("nan"), tree_fields=family.tree_json(tree),
      nodes={b: n for n, b in by_nodes.items()} if family.reports_nodes else None,
      model=family.model,
      calibration={by_nodes[n]: measured for n, measured in sorted(calibration.items())})
  measured = ", ".join(f"{a:.2f} at {family.budget_name}={by_nodes[n]}"
                       for n, (a, _) in sorted(calibration.items()))
  log(f"{p} acceptance {measured}; overhead {overhead * 1e3:.1f} ms/round -> "
      f"{family.budget_name}={budget} ({family.describe(tree)}); expected "
      f"{rates[budget]:.1f} tok/s")
  return choice


def dart_family(head, ngram=None, topk: int | None = None,
                beam_width: int | None = None) -> TreeFamily:
  """DART: budget = ``TreeConfig.remain_total`` = draft nodes (see the module
  docstring); calibrated with ``generate(draft=head, ngram=ngram, tree=...)``."""
  return TreeFamily(
      tree_for=lambda budget: tree_config_for(budget, topk, beam_width),
      generate_kwargs=lambda tree: dict(draft=head, ngram=ngram, tree=tree),
      max_path=head.config.draft_length + 1, budget_name="remain_total",
      describe=lambda tree: f"topk {tree.topk}, beam {tree.beam_width}",
      tree_json=lambda tree: {"topk": tree.topk, "beam_width": tree.beam_width})


def auto_tree_budget(target, head, ngram=None, *, topk: int | None = None,
                     beam_width: int | None = None, sizes=VERIFY_SIZES,
                     context_len: int = 192, reps: int = 7, log=print) -> BudgetChoice:
  """DART's measured tree budget (``--tree-budget auto``): a ``BudgetChoice``
  whose tree is a ``TreeConfig`` with ``remain_total`` = the chosen budget."""
  return choose_budget(target, dart_family(head, ngram, topk, beam_width), sizes=sizes,
                       context_len=context_len, reps=reps, log=log)


def dartree_family(drafter, method: str = "dartree", base_config=None, *,
                   label: str | None = None) -> TreeFamily:
  """A DARTree method on a DFlash/Domino or DART-GRU drafter: budget =
  ``DARTreeConfig.budget``, the other fields ``base_config``'s (default: the
  drafter's measured settings where it has them, else ``DARTreeConfig()``);
  nodes = ``num_tree_nodes`` (see the module docstring).

  method: "dartree", "dartree-fixed" or "ddtree" (chains take no budget);
  label: the method's name in the log (default ``method``).
  Raises InputError for a chain or a drafter that builds no DARTree trees,
  ConfigError for a method the drafter cannot run.
  """
  typed = method_for(drafter, tree=method, tree_config=base_config)
  if not hasattr(typed, "tree_facts"):
    raise InputError(f"the DARTree budget needs a DFlashDrafter or DartGruDrafter, got "
                     f"{type(drafter).__name__}")
  base_config = typed.config  # base_config, else the drafter's measured settings
  resolved, depths, vocab, taps = typed.tree_facts()
  if resolved in ("dflash-chain", "domino-chain"):
    raise InputError(f"method {method!r} is a chain of {depths} nodes: it takes no "
                     "budget to choose")

  def tree_for(budget: int):
    return dataclasses.replace(base_config, budget=budget)

  def nodes(tree) -> int:
    return num_tree_nodes(resolved, tree, depths, vocab)

  def describe(tree) -> str:
    n = nodes(tree)
    return (f"{n} node{'s' if n != 1 else ''}; topk {tree.topk}, width "
            f"{tree.supertree_width}, depth bonus {tree.depth_bonus:g}")

  return TreeFamily(
      tree_for=tree_for,
      generate_kwargs=lambda tree: dict(draft=drafter, tree=method, tree_config=tree),
      max_path=depths + 1, nodes_for=lambda budget: nodes(tree_for(budget)), taps=taps,
      budget_name="budget", describe=describe,
      tree_json=lambda tree: {"method": resolved, "topk": tree.topk,
                              "supertree_width": tree.supertree_width,
                              "depth_bonus": tree.depth_bonus},
      log_prefix=f"[dartree-budget] {label or method}:", model=DARTREE_MODEL,
      reports_nodes=True)


def auto_dartree_budget(target, drafter, method: str = "dartree", base_config=None, *,
                        sizes=VERIFY_SIZES, context_len: int = 192, reps: int = 7,
                        verify_costs: dict[int, float] | None = None,
                        label: str | None = None, log=print) -> BudgetChoice:
  """A DARTree method's measured budget (``--dartree-budget auto``): a
  ``BudgetChoice`` whose tree is ``base_config`` (default as ``dartree_family``)
  with ``budget`` = the chosen one. ``verify_costs``: see ``choose_budget``."""
  family = dartree_family(drafter, method, base_config, label=label)
  return choose_budget(target, family, sizes=sizes, context_len=context_len, reps=reps,
                       verify_costs=verify_costs, log=log)
