"""Shared pieces of the benchmark and tree budget tests (infer.bench*, dart_jax.tree_budget)."""

import functools

import dart_jax as dj
from tests.helpers import FIXTURES

# D of the tests' random DART head (and the draft depths of their random drafters).
DRAFT_LENGTH = 2


@functools.cache
def tiny() -> tuple[dj.Target, dj.DartHead]:
  """tiny_llama (3 layers, with a tokenizer and chat template) and a random head
  made as ``--draft random --draft-length 2`` makes it; loaded once per session."""
  target = dj.load_target(FIXTURES / "tiny_llama")
  head = dj.DartHead.init(target, draft_length=DRAFT_LENGTH, seed=0)
  return target, head
