"""The self-distillation prompt generator: reproducible, broad, benchmark-free."""

import collections
import json

import pytest

from dart_jax.errors import InputError
from infer import datasets
from train import prompts


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
