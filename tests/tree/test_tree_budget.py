"""The tree budget (dart_jax.tree_budget): the pure choice and the measured one."""

import math

import numpy as np
import pytest

import dart_jax as dj
from dart_jax.tree.dartree import DARTreeConfig
from dart_jax import tree_budget as tb
from tests.infer import bench_helpers
from tests.infer.bench_helpers import DRAFT_LENGTH

# Verify seconds per T: flat up to 8 tokens, then growing (a CPU-like curve).
COSTS = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.3, 16: 2.0, 32: 2.5, 64: 5.0}
ACCEPT = {1: 1.5, 3: 2.0, 7: 2.8, 15: 3.2, 31: 3.4, 63: 3.5}


def test_choose_tree_budget_picks_the_fastest_point():
  # Rates by hand: N=1 1.5, N=3 2.0, N=7 2.8/1.3=2.154, N=15 1.6, N=31 1.36, N=63 0.7.
  assert tb.choose_tree_budget(COSTS, ACCEPT) == 7
  # A per-round overhead of 3 s favours bigger trees: N=7 2.8/4.3=0.651,
  # N=15 3.2/5=0.640, N=31 3.4/5.5=0.618 -> still 7; with 10 s: N=7 2.8/11.3=0.248,
  # N=15 3.2/12=0.267, N=31 3.4/12.5=0.272, N=63 3.5/15=0.233 -> 31.
  assert tb.choose_tree_budget(COSTS, ACCEPT, overhead_s=3.0) == 7
  assert tb.choose_tree_budget(COSTS, ACCEPT, overhead_s=10.0) == 31
  # A flat cost curve makes the largest tree best; equal rates pick the smaller N.
  flat = {t: 1.0 for t in COSTS}
  assert tb.choose_tree_budget(flat, ACCEPT) == 63
  assert tb.choose_tree_budget(flat, lambda n: 1.0) == 1
  rates = tb.expected_rates(COSTS, ACCEPT)
  assert sorted(rates) == [1, 3, 7, 15, 31, 63]
  assert rates[7] == pytest.approx(2.8 / 1.3, rel=1e-12)


def test_choose_tree_budget_rejects_curves_without_candidates():
  with pytest.raises(dj.InputError, match="at least one T >= 2"):
    tb.choose_tree_budget({1: 1.0}, ACCEPT)
  with pytest.raises(dj.InputError, match="must be > 0"):
    tb.choose_tree_budget({1: 1.0, 2: 0.0}, ACCEPT)


def test_accept_curve_through_one_point_is_the_log_prior():
  accept = tb.accept_curve({63: 3.0}, max_depth=8)
  assert accept(0) == pytest.approx(1.0, abs=1e-12)
  assert accept(63) == pytest.approx(3.0, abs=1e-12)
  assert accept(7) == pytest.approx(1 + 2 * math.log(8) / math.log(64), abs=1e-12)
  values = [accept(n) for n in (1, 3, 7, 15, 31, 63)]
  gains = np.diff(values)
  assert np.all(gains > 0) and np.all(np.diff(gains) < 1e-12)  # concave in log steps
  assert tb.accept_curve({63: 9.0}, max_depth=5)(63) == 5.0  # capped at D+1
  assert tb.accept_curve({63: 0.7}, max_depth=5)(15) == 1.0  # never below 1
  assert tb.accept_curve({63: 9.0}, max_depth=16)(1) == 2.0  # 1 node: <= 2 tokens
  # With the prior and the CPU-like costs: N=3 gives 1+2*log4/log64=1.667 -> 1.667,
  # N=7: 2.0/1.3=1.538, N=1: 1.333 -> N=3.
  assert tb.choose_tree_budget(COSTS, accept) == 3


def test_accept_curve_through_two_points():
  accept = tb.accept_curve({7: 2.5, 63: 3.0}, max_depth=8)
  assert accept(7) == pytest.approx(2.5, abs=1e-12)
  assert accept(63) == pytest.approx(3.0, abs=1e-12)
  # Below the small point: from (0, 1) to (7, 2.5); between them: log-linear.
  assert accept(3) == pytest.approx(1 + 1.5 * math.log(4) / math.log(8), abs=1e-12)
  assert accept(15) == pytest.approx(2.5 + 0.5 * math.log(2) / math.log(8), abs=1e-12)
  assert accept(127) == pytest.approx(3.0, abs=1e-12)  # constant past the largest point
  # A smaller tree measured better than a larger one: the curve does not fall.
  falling = tb.accept_curve({7: 2.5, 63: 2.0}, max_depth=8)
  assert falling(63) == pytest.approx(2.5, abs=1e-12)
  # A head that accepts most of its tokens within 7 nodes: with the CPU-like costs
  # N=3 gives 1 + 2.5*2/3 = 2.667, N=7 3.5/1.3 = 2.692, N=15 3.533/2 -> 7. The
  # one-point prior through (63, 3.6) chooses 3: 1 + 2.6/3 = 1.867 against
  # (1 + 2.6/2)/1.3 = 1.769.
  assert tb.choose_tree_budget(COSTS, tb.accept_curve({7: 3.5, 63: 3.6}, 8)) == 7
  assert tb.choose_tree_budget(COSTS, tb.accept_curve({63: 3.6}, 8)) == 3


def test_calibration_nodes():
  assert tb.calibration_nodes((1, 3, 7, 15, 31, 63)) == (63, 7)
  assert tb.calibration_nodes((1, 3, 7, 15)) == (15, 3)  # log(16)/2 = log(4)
  assert tb.calibration_nodes((1, 3, 4)) == (4,)  # small trees: one run
  assert tb.calibration_nodes((1, 3, 6)) == (6,)
  assert tb.calibration_nodes((1, 2, 40)) == (40,)  # no candidate of >= 3 nodes below


def test_tree_config_for_caps_topk_and_beam():
  assert (tb.tree_config_for(8).topk, tb.tree_config_for(8).beam_width) == (8, 8)
  big = tb.tree_config_for(63)
  assert (big.topk, big.beam_width, big.remain_total) == (25, 20, 63)
  given = tb.tree_config_for(4, topk=10, beam_width=3)
  assert (given.topk, given.beam_width, given.remain_total) == (10, 3, 4)


def test_binary_tree_mask():
  mask, depth = tb.binary_tree_mask(5)
  assert depth.tolist() == [0, 1, 1, 2, 2]
  expected = np.array([[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 0, 1, 0, 0],
                       [1, 1, 0, 1, 0],
                       [1, 1, 0, 0, 1]], bool)
  np.testing.assert_array_equal(mask, expected)


@pytest.fixture(scope="module")
def tiny():
  return bench_helpers.tiny()


def test_measure_verify_costs_times_every_size(tiny):
  target, _ = tiny
  costs = tb.measure_verify_costs(target, (1, 4), context_len=40, reps=3)
  assert sorted(costs) == [1, 4]
  assert all(0 < c < 5.0 for c in costs.values())


def test_auto_tree_budget_measures_and_chooses(tiny):
  target, head = tiny
  logged = []
  choice = tb.auto_tree_budget(target, head, sizes=(1, 4), context_len=40, reps=3,
                               log=logged.append)
  # Only T=4 is a candidate (T=1 is plain decoding): N = 3, topk/beam capped at 3.
  assert choice.budget == 3 and choice.max_budget == 3
  assert (choice.tree.topk, choice.tree.beam_width, choice.tree.remain_total) == (3, 3, 3)
  assert 1.0 <= choice.accept_at_max <= DRAFT_LENGTH + 1
  assert choice.round_s_at_max > 0 and choice.overhead_s >= 0
  assert choice.ar_tokens_per_s == pytest.approx(1 / choice.verify_costs[1], rel=1e-12)
  doc = choice.to_json()
  assert set(doc["verify_ms"]) == {"1", "4"} and doc["budget"] == 3
  assert any("remain_total=3" in line for line in logged)


def _fake_measurements(monkeypatch, costs, calibration):
  """Replaces the timing and the calibration runs by fixed numbers (calibration:
  {budget: (acceptance, seconds per round)}); returns the lists of requested sizes
  and of calibration kwargs."""
  measured, calibrated = [], []

  def measure(target, sizes, **kwargs):
    measured.append(tuple(sizes))
    return {t: costs[t] for t in sizes}

  def calibrate(target, method_kwargs, **kwargs):
    calibrated.append(method_kwargs)
    tree = method_kwargs.get("tree_config") or method_kwargs["tree"]
    return calibration[getattr(tree, "budget", None) or tree.remain_total]

  monkeypatch.setattr(tb, "measure_verify_costs", measure)
  monkeypatch.setattr(tb, "calibrate", calibrate)
  return measured, calibrated


def test_dart_and_dartree_choices_agree_on_the_same_curve(tiny, monkeypatch):
  """One implementation: with the same verify costs, calibration runs and longest
  path (D = 2 draft depths: 3 tokens), DART and a DARTree method whose node
  count equals its budget choose the same budget."""
  target, head = tiny
  # Calibrated at 63 nodes (3.0 tokens, 15 s/round: overhead 15 - 5 = 10 s) and
  # at 7 (2.6 tokens, 4.3 s: overhead 4.3 - 1.3 = 3 s). Between the points both
  # are linear in log(1 + N), so in thirds from 7 to 15, 31, 63:
  # N=1: (1 + 1.6/3) / (1 + 3) = 0.383, N=3: (1 + 3.2/3) / 4 = 0.517,
  # N=7: 2.6 / 4.3 = 0.605, N=15: 2.733 / (2 + 5.333) = 0.373,
  # N=31: 2.867 / (2.5 + 7.667) = 0.282, N=63: 3 / 15 = 0.2 -> 7.
  calibration = {63: (3.0, 15.0), 7: (2.6, 4.3)}
  measured, calibrated = _fake_measurements(monkeypatch, COSTS, calibration)
  dart = tb.auto_tree_budget(target, head, log=lambda msg: None)
  assert dart.budget == 7 and dart.tree.remain_total == 7
  assert dart.overhead_s == pytest.approx(3.0, abs=1e-12)
  assert dart.expected_tokens_per_s[15] == pytest.approx((2.6 + 0.4 / 3) / (2 + 3 + 7 / 3))
  assert [kw["tree"].remain_total for kw in calibrated] == [63, 7]
  assert calibrated[0]["draft"] is head
  assert dart.calibration == {7: (2.6, 4.3), 63: (3.0, 15.0)}
  assert dart.to_json()["calibration"] == {"7": {"accept": 2.6, "round_ms": 4300.0},
                                           "63": {"accept": 3.0, "round_ms": 15000.0}}
  drafter = dj.DFlashDrafter.init(target, block_size=DRAFT_LENGTH + 1, domino=True)
  # ddtree with K = 64 >= 63: every budget up to 63 builds exactly that many nodes.
  base = DARTreeConfig(topk=64, supertree_width=5, depth_bonus=-0.5)
  tree = tb.auto_dartree_budget(target, drafter, "ddtree", base, log=lambda msg: None)
  assert tree.budget == dart.budget
  assert tree.expected_tokens_per_s == pytest.approx(dart.expected_tokens_per_s, rel=1e-12)
  assert tree.tree == DARTreeConfig(topk=64, supertree_width=5, budget=7, depth_bonus=-0.5)
  assert measured == [tb.VERIFY_SIZES] * 2
  assert calibrated[2]["tree"] == "ddtree"
  assert [kw["tree_config"].budget for kw in calibrated[2:]] == [63, 7]
  # The pure choice gives the same answer from the same numbers; calibrated at
  # 63 nodes only (the log prior), it chooses 31: N=7 2.0/11.3 = 0.177,
  # N=15 2.333/12 = 0.194, N=31 2.667/12.5 = 0.213, N=63 3.0/15 = 0.200.
  identity = {n: n for n in (1, 3, 7, 15, 31, 63)}
  assert tb.pick_budget(COSTS, identity, {7: (2.6, 4.3), 63: (3.0, 15.0)}, 3)[0] == 7
  assert tb.pick_budget(COSTS, identity, {63: (3.0, 15.0)}, 3)[:2] == (31, 10.0)


def test_dartree_fixed_candidates_are_the_node_counts_it_builds(tiny, monkeypatch):
  """dartree-fixed with D = 2 depths and K = 2: budget 1 builds 1 node, 3 builds
  2 + 1, and 7 or more build 2 + 4 = 6 (depth 1 holds at most K, depth 2 at most
  2K). The candidates are 1, 3, 6 nodes, timed at T = 2, 4, 7."""
  target, _ = tiny
  costs = {1: 1.0, 2: 1.0, 4: 1.0, 7: 1.1}
  # L_max 2.5 at 6 nodes, no overhead: accept(n) = 1 + 1.5 log(1+n)/log 7:
  # n=1: 1.534/1.0, n=3: 2.069/1.0, n=6: 2.5/1.1 = 2.273 -> 6 nodes, budget 7.
  measured, calibrated = _fake_measurements(monkeypatch, costs, {7: (2.5, 1.1)})
  drafter = dj.DFlashDrafter.init(target, block_size=3, domino=True)
  shared = {}
  choice = tb.auto_dartree_budget(target, drafter, "dartree-fixed",
                                  DARTreeConfig(topk=2), verify_costs=shared,
                                  log=lambda msg: None)
  assert measured == [(1, 2, 4, 7)]
  assert choice.nodes == {1: 1, 3: 3, 7: 6}
  assert (choice.budget, choice.max_budget) == (7, 7)
  assert calibrated[0]["tree"] == "dartree-fixed"
  assert calibrated[0]["tree_config"] == DARTreeConfig(topk=2, budget=7)
  assert choice.expected_tokens_per_s == pytest.approx(
      {1: 1 + 1.5 * math.log(2) / math.log(7), 3: 1 + 1.5 * math.log(4) / math.log(7),
       7: 2.5 / 1.1}, rel=1e-12)
  doc = choice.to_json()
  assert (doc["budget"], doc["nodes"], doc["max_nodes"], doc["method"]) == (
      7, 6, 6, "dartree-fixed")
  assert doc["nodes_per_budget"] == {"1": 1, "3": 3, "7": 6}
  # Given costs are reused when they hold every size; the pruned tree (widths 2,
  # 2: at most 4 nodes) also needs T = 5, so its sizes are timed together again.
  assert shared == costs
  assert tb.auto_dartree_budget(target, drafter, "dartree-fixed", DARTreeConfig(topk=2),
                                verify_costs=shared, log=lambda msg: None).budget == 7
  assert measured == [(1, 2, 4, 7)]
  costs[5] = 1.05
  pruned = tb.dartree_family(drafter, "dartree", DARTreeConfig(topk=2, supertree_width=2))
  assert tb.verify_sizes(pruned) == (1, 2, 4, 5)
  tb.choose_budget(target, pruned, verify_costs=shared, log=lambda msg: None)
  assert measured == [(1, 2, 4, 7), (1, 2, 4, 5)]
  with pytest.raises(dj.InputError, match="chain of 2 nodes: it takes no budget"):
    tb.auto_dartree_budget(target, drafter, "domino-chain", log=lambda msg: None)
  with pytest.raises(dj.ConfigError, match="needs the Domino correction head"):
    tb.auto_dartree_budget(target, dj.DFlashDrafter.init(target, block_size=3), "dartree",
                           log=lambda msg: None)


def test_auto_dartree_budget_measures_and_chooses(tiny):
  """The real path on tiny_llama with a random Domino drafter (D = 2, K = 2,
  width 2): budgets 1, 3, 7 build 1, 3, 4 nodes (the pruned tree holds at most
  2 + 2)."""
  target, _ = tiny
  drafter = dj.DFlashDrafter.init(target, block_size=3, domino=True)
  base = DARTreeConfig(topk=2, supertree_width=2)
  logged = []
  # After test_bench's --dartree-budget auto CLI test (same drafter and tree): its
  # compiled calibration rounds are reused when both run in one session.
  choice = tb.auto_dartree_budget(target, drafter, "dartree", base, sizes=(1, 2, 4, 8),
                                  reps=3, log=logged.append)
  assert choice.nodes == {1: 1, 3: 3, 7: 4}
  assert choice.budget in choice.nodes and choice.max_budget == 7
  assert isinstance(choice.tree, DARTreeConfig)
  assert choice.tree == DARTreeConfig(topk=2, supertree_width=2, budget=choice.budget)
  assert sorted(choice.verify_costs) == [1, 2, 4, 5]
  assert all(0 < c < 5.0 for c in choice.verify_costs.values())
  assert 1.0 <= choice.accept_at_max <= 3.0  # D + 1 tokens at most
  assert choice.round_s_at_max > 0 and choice.overhead_s >= 0
  assert set(choice.expected_tokens_per_s) == {1, 3, 7}
  assert any(line.startswith("[dartree-budget] dartree: ") and
             f"-> budget={choice.budget} ({choice.nodes[choice.budget]} node" in line
             for line in logged), logged
