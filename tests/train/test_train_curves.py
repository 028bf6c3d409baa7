"""Training-curve figure of consecutive runs."""

import importlib.util
import json

import pytest

from dart_jax.errors import InputError
from train import curves


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _record(split, step, loss):
  return {"split": split, "step": step, "loss": loss, "acc": [0.1 * step, 0.01 * step]}


def test_later_stages_continue_the_step_count(tmp_path):
  first = _write(tmp_path / "a.jsonl", [_record("train", 5, 9.0), _record("train", 10, 8.0),
                                        _record("eval", 10, 8.5)])
  second = _write(tmp_path / "b.jsonl", [_record("train", 4, 7.0), _record("eval", 8, 7.5),
                                         _record("train", 8, 6.0)])
  merged, ends = curves.merge_stages(curves.read_stages([first, second]))
  assert ends == [10, 18]
  assert [(r["split"], r["step"], r["stage"]) for r in merged] == [
      ("train", 5, 0), ("train", 10, 0), ("eval", 10, 0),
      ("train", 14, 1), ("eval", 18, 1), ("train", 18, 1)]
  train = curves.series(merged, "train")
  assert train.steps == [5, 10, 14, 18] and train.loss == [9.0, 8.0, 7.0, 6.0]
  assert curves.series(merged, "eval").steps == [10, 18]


def test_a_merged_file_stands_for_its_stages(tmp_path):
  first = [_record("train", 5, 9.0), _record("eval", 10, 8.5)]
  second = [_record("train", 4, 7.0), _record("train", 8, 6.0)]
  merged, _ = curves.merge_stages([first, second])
  merged_path = _write(tmp_path / "merged.jsonl", merged)
  third = _write(tmp_path / "c.jsonl", [_record("train", 3, 5.0)])
  stages = curves.read_stages([merged_path, third])
  assert stages == [first, second, [_record("train", 3, 5.0)]]
  again, ends = curves.merge_stages(stages)
  assert ends == [10, 18, 21]
  assert again[:len(merged)] == merged


def test_missing_or_empty_metrics_are_clear_errors(tmp_path):
  with pytest.raises(InputError, match="not found"):
    curves.read_stages([str(tmp_path / "nope.jsonl")])
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(InputError, match="holds no metrics"):
    curves.read_stages([str(empty)])
  assert curves.main([str(empty), "--out", str(tmp_path / "x.png")]) == 2


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (the [bench] extra) is not installed")
def test_cli_writes_the_png_and_the_merged_records(tmp_path):
  first = _write(tmp_path / "a.jsonl", [_record("train", 5, 9.0), _record("eval", 5, 9.5)])
  second = _write(tmp_path / "b.jsonl", [_record("train", 5, 7.0)])
  out, merged = tmp_path / "curve.png", tmp_path / "merged.jsonl"
  assert curves.main([first, second, "--out", str(out), "--merged", str(merged)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  lines = [json.loads(line) for line in merged.read_text().splitlines()]
  assert [(r["step"], r["stage"]) for r in lines] == [(5, 0), (5, 0), (10, 1)]
