"""Shared pieces of the trainer tests (DART head and DFlash/Domino drafters)."""

import json
import os

import jax.numpy as jnp
import numpy as np

import pytest

from train import loop
from train import main as train_main

STEPS = 60
OVERRIDES = [f"steps={STEPS}", "optim.warmup_steps=5", "checkpoint_every=20",
             "eval_every=60", "log_every=10", "progress=false"]


def run_preset(preset: str, workdir: str, extra: list[str] = ()) -> str:
  """An uninterrupted ``STEPS``-step run of ``preset`` through the CLI entry point
  (``extra`` overrides come after the shared ones)."""
  assert train_main.main(["--config", preset, "--workdir", workdir] + OVERRIDES
                         + list(extra)) == 0
  return workdir


def metric_records(workdir: str) -> list[dict]:
  """The lines of ``workdir/metrics.jsonl``."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def packed_batch(vocab: int) -> dict:
  """One row of 24 tokens: segment 1 = positions 0..13, segment 2 = 14..21, 2 pad."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, vocab, (1, 24)).astype(np.int32)
  seg = np.array([[1] * 14 + [2] * 8 + [0] * 2], np.int32)
  pos = np.array([list(range(14)) + list(range(8)) + [0, 0]], np.int32)
  tokens[0, 22:] = 0
  loss_mask = (seg > 0) & (pos > 0)
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg),
          "positions": jnp.asarray(pos), "loss_mask": jnp.asarray(loss_mask)}


class Crash(Exception):
  """Raised by ``crash_then_resume``'s step callback (a simulated interruption)."""


def crash_then_resume(config, workdir: str, crash_step: int = 25):
  """Trains until ``crash_step`` (between the checkpoints of steps 20 and 40),
  crashes there, then reruns: -> (export dir existed after the crash, result)."""

  def crash(step, metrics):
    if step == crash_step:
      raise Crash()

  with pytest.raises(Crash):
    loop.train(config, workdir, step_callback=crash)
  exported_early = os.path.exists(os.path.join(workdir, "export"))
  return exported_early, loop.train(config, workdir)
