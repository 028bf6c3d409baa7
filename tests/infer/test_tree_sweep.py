"""infer.tree_sweep: development prompts, and a sweep that stays lossless."""

import json
import lzma

import pytest

import dart_jax as dj
from dart_jax.tree import DARTreeConfig
from infer import tree_sweep
from tests.infer import bench_helpers
from train.configs import SMOLLM2_V2_HELDOUT, SMOLLM2_V2_TRAIN


def test_dev_prompts_are_evenly_spaced_held_out_first_messages():
  with lzma.open(SMOLLM2_V2_HELDOUT, "rt", encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  prompts = tree_sweep.dev_prompts(4)
  step = len(records) // 4
  assert prompts == [records[i]["messages"][0]["content"] for i in (0, step, 2 * step,
                                                                     3 * step)]
  trained = set()
  for path in SMOLLM2_V2_TRAIN:
    with lzma.open(path, "rt", encoding="utf-8") as f:
      trained |= {json.loads(line)["messages"][0]["content"] for line in f}
  assert not set(tree_sweep.dev_prompts(32)) & trained  # held out from training
  with pytest.raises(dj.InputError, match="--prompts must be in 1.."):
    tree_sweep.dev_prompts(0)


def test_sweep_is_lossless_and_reports_every_method():
  target, head = bench_helpers.tiny()
  prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 6, 2, 9]]
  runs = tree_sweep.sweep(target, tree_sweep.dart_trees(head, None, [2, 3]), prompts,
                          max_new_tokens=8)
  assert list(runs) == ["ar", "2 nodes", "3 nodes"]
  for run in runs.values():
    assert run["tokens"] == runs["ar"]["tokens"]  # greedy DART == greedy AR
    assert len(run["tokens_per_s"]) == len(run["accept"]) == 2
  lines = tree_sweep.report(runs).splitlines()
  assert len(lines) == 3 and all(line.endswith("greedy == AR 2/2") for line in lines)
  assert "1.000x of AR" in lines[0]


def test_dartree_sweep_is_lossless_and_parses_its_trees():
  target, _ = bench_helpers.tiny()
  drafter = dj.DFlashDrafter.init(target, block_size=4, domino=True, seed=0)
  trees = tree_sweep.parse_dartree_trees("3:2:4,6:3:4:-1")
  assert [(t.budget, t.supertree_width, t.topk, t.depth_bonus) for t in trees] == [
      (3, 2, 4, DARTreeConfig().depth_bonus), (6, 3, 4, -1.0)]
  prompts = [[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 6, 2, 9]]
  runs = tree_sweep.sweep(target, tree_sweep.dartree_trees(drafter, trees), prompts,
                          max_new_tokens=8)
  assert list(runs) == ["ar", "domino-chain", "dartree 3:2:4", "dartree 6:3:4:-1"]
  for run in runs.values():
    assert run["tokens"] == runs["ar"]["tokens"]  # greedy DARTree == greedy AR
  with pytest.raises(dj.InputError, match="budget:width:topk"):
    tree_sweep.parse_dartree_trees("8:4")
  with pytest.raises(dj.InputError, match="depth_bonus"):
    tree_sweep.parse_dartree_trees("8:4:8:-0.5:1")
