"""The self-distillation prompt generator: reproducible, broad, benchmark-free."""

import collections
import json

import pytest

from dart_jax.errors import InputError
from infer import datasets
from train import configs, prompts


def test_same_seed_same_prompts_other_seed_differs():
  a = prompts.generate_prompts(60, seed=3)
  b = prompts.generate_prompts(60, seed=3)
  c = prompts.generate_prompts(60, seed=4)
  assert a == b
  assert a != c


def test_prompts_are_distinct_and_cover_every_family():
  records = prompts.generate_prompts(800, seed=0)
  firsts = [r["messages"][0]["content"] for r in records]
  assert len(set(firsts)) == len(firsts)
  counts = collections.Counter(r["family"] for r in records)
  assert set(counts) == set(prompts.FAMILIES)
  assert max(counts.values()) - min(counts.values()) <= 1
  follow_ups = sum(len(r["messages"]) == 2 for r in records)
  assert 0.2 < follow_ups / len(records) < 0.4
  for r in records:
    assert all(m["role"] == "user" and m["content"].strip() for m in r["messages"])


def test_no_benchmark_prompt_is_generated():
  records = prompts.generate_prompts(1600, seed=0)
  texts = {m["content"].strip() for r in records for m in r["messages"]}
  bench = {t.strip() for q in datasets.load_mt_bench() for t in q.turns}
  entry_points = {p.entry_point for p in datasets.load_humaneval()}
  assert not texts & bench
  stub_names = {stub[0] for stub in prompts.FUNCTION_STUBS}
  assert not stub_names & entry_points, "a code-completion stub reuses a HumanEval function"


def test_cli_writes_jsonl(tmp_path):
  out = tmp_path / "p.jsonl"
  assert prompts.main(["--num", "10", "--seed", "1", "--out", str(out)]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert lines == prompts.generate_prompts(10, seed=1)


def test_bad_arguments():
  with pytest.raises(InputError, match="num"):
    prompts.generate_prompts(0)
  with pytest.raises(InputError, match="follow_up_fraction"):
    prompts.generate_prompts(5, follow_up_fraction=1.5)
  with pytest.raises(InputError, match="distinct"):
    prompts.generate_prompts(100000)


def test_v1_output_is_frozen_by_the_shipped_data():
  # The shipped head's data was regenerated from v1 seed 0; its first user
  # turns must still be what v1 generates, or the asset recipe no longer holds.
  with open(configs.SMOLLM2_SELF_DISTILLED, encoding="utf-8") as f:
    shipped = [json.loads(line) for line in f]
  firsts = {r["index"]: r["messages"][0]["content"] for r in shipped[:50]}
  generated = prompts.generate_prompts(max(firsts) + 1, seed=0)
  for index, text in firsts.items():
    assert generated[index]["messages"][0]["content"] == text


def test_v2_reaches_ten_thousand_distinct_conversations_over_every_family():
  records = prompts.generate_prompts(12000, seed=0, recipe="v2")
  firsts = [r["messages"][0]["content"] for r in records]
  assert len(set(firsts)) == len(firsts) == 12000
  counts = collections.Counter(r["family"] for r in records)
  assert set(counts) == set(prompts.FAMILIES_V2)
  assert min(counts.values()) >= 200, counts
  turns = collections.Counter(len(r["messages"]) for r in records)
  assert turns[2] > 0.15 * len(records) and turns[3] > 0.03 * len(records)
  assert all("{" not in m["content"] or "```" in m["content"]
             for r in records for m in r["messages"]), "an unfilled template field"
  bench = {t.strip() for q in datasets.load_mt_bench() for t in q.turns}
  assert not {m["content"].strip() for r in records for m in r["messages"]} & bench
  assert prompts.generate_prompts(500, seed=0, recipe="v2") == records[:500]


def test_heldout_split_is_disjoint_and_written_apart(tmp_path):
  out, held = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
  assert prompts.main(["--recipe", "v2", "--num", "300", "--heldout", "40", "--out", str(out),
                       "--heldout-out", str(held)]) == 0
  train = [json.loads(line) for line in out.read_text().splitlines()]
  heldout = [json.loads(line) for line in held.read_text().splitlines()]
  assert (len(train), len(heldout)) == (260, 40)
  assert train + heldout == prompts.generate_prompts(300, seed=0, recipe="v2")
  assert not ({r["messages"][0]["content"] for r in train}
              & {r["messages"][0]["content"] for r in heldout})
  assert prompts.main(["--num", "10", "--heldout", "3", "--out", str(out)]) == 2
  with pytest.raises(InputError, match="recipe"):
    prompts.generate_prompts(5, recipe="v9")
