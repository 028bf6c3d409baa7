"""Training curves of one or more consecutive runs (stages) as a PNG.

  python -m train.curves runs/stage1/metrics.jsonl runs/stage2/metrics.jsonl \
      --out training_curve.png [--title TEXT]

Each file is a run's ``metrics.jsonl``; a later stage (a run continued with
``head.init_from``) restarts its step count, so its steps are shifted to follow
the previous stage's last step (dotted lines mark the stage ends). A file
written by ``--merged`` (records with a ``stage`` field) stands for all of its
stages, so a new stage can be appended to a shipped curve:

  python -m train.curves merged.jsonl runs/stage6/metrics.jsonl --out curve.png

Left: train and eval loss; right: train top-1 accuracy per draft level (DART) or
block slot (DFlash / Domino).
"""

import argparse
import json
import os
import sys
from typing import NamedTuple, Sequence

from dart_jax.errors import InputError


class Series(NamedTuple):
  """One split's records over all stages, in order: global step, loss and
  per-level accuracies of each record."""

  steps: list[int]
  loss: list[float]
  acc: list[list[float]]


def read_stages(paths: Sequence[str]) -> list[list[dict]]:
  """The records of each stage, in order: one stage per ``metrics.jsonl``, and
  every stage of a merged file (``split_merged``); InputError for a missing or
  empty file."""
  stages = []
  for path in paths:
    if not os.path.isfile(path):
      raise InputError(f"metrics file not found: {path!r}")
    with open(path) as f:
      records = [json.loads(line) for line in f if line.strip()]
    if not records:
      raise InputError(f"{path!r} holds no metrics")
    stages.extend(split_merged(records) if "stage" in records[0] else [records])
  return stages


def split_merged(merged: Sequence[dict]) -> list[list[dict]]:
  """The inverse of ``merge_stages``: each stage's records with its own steps.

  A stage's global steps start after the previous stage's last step, which is
  the largest global step among the previous stage's records.
  """
  by_stage: dict[int, list[dict]] = {}
  for record in merged:
    by_stage.setdefault(record["stage"], []).append(record)
  stages, offset = [], 0
  for index in sorted(by_stage):
    records = by_stage[index]
    stages.append([{**{k: v for k, v in r.items() if k != "stage"},
                    "step": r["step"] - offset} for r in records])
    offset = max(r["step"] for r in records)
  return stages


def merge_stages(stages: Sequence[Sequence[dict]]) -> tuple[list[dict], list[int]]:
  """Records of all stages with global steps and a ``stage`` index (0-based),
  and the global step where each stage ends."""
  merged, ends = [], []
  offset = 0
  for index, records in enumerate(stages):
    merged.extend({**r, "step": offset + r["step"], "stage": index} for r in records)
    offset += max(r["step"] for r in records)
    ends.append(offset)
  return merged, ends


def series(records: Sequence[dict], split: str) -> Series:
  """The records of ``split``."""
  chosen = [r for r in records if r["split"] == split]
  return Series([r["step"] for r in chosen], [r["loss"] for r in chosen],
                [r["acc"] for r in chosen])


def plot(stages: Sequence[Sequence[dict]], out: str, title: str = "") -> None:
  """Writes the two-panel figure to ``out``."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise InputError("train.curves needs matplotlib: pip install matplotlib "
                     "(or the [bench] extra)") from e
  records, stage_ends = merge_stages(stages)
  train, ev = series(records, "train"), series(records, "eval")
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
  left.plot(train.steps, train.loss, label="train")
  if ev.steps:
    left.plot(ev.steps, ev.loss, "o-", label="eval")
  left.set(xlabel="step", ylabel="loss (sum of weighted KL)")
  left.legend()
  for level in range(len(train.acc[0]) if train.acc else 0):
    right.plot(train.steps, [a[level] for a in train.acc], label=f"level {level}")
  right.set(xlabel="step", ylabel="top-1 accuracy (train)")
  right.legend(fontsize="x-small")
  for axis in (left, right):
    for end in stage_ends[:-1]:
      axis.axvline(end, color="grey", linestyle=":", linewidth=1)
  if title:
    fig.suptitle(title, fontsize="medium")
  fig.tight_layout()
  fig.savefig(out, dpi=80)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m train.curves", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("metrics", nargs="+", help="metrics.jsonl of each stage, in order")
  parser.add_argument("--out", required=True, help="PNG to write")
  parser.add_argument("--title", default="")
  parser.add_argument("--merged", help="also write the stages' records as one JSONL "
                      "(global steps, a 'stage' field)")
  args = parser.parse_args(argv)
  try:
    stages = read_stages(args.metrics)
    plot(stages, args.out, args.title)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.merged:
    with open(args.merged, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in merge_stages(stages)[0])
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
