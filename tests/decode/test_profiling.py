"""The profile mode: phases compiled once per configuration and timed; a profiled
DARTree run emits the fused run's tokens (the fused run's equality with AR is
test_dartree_decode's).

The DARTree test runs test_dartree_decode's 2-layer Llama, Domino drafter, tree
and prompts (batch 4, 20 new tokens), so in one pytest process the fused round
compiles once for both files; the phased round adds about 5 s of compiling.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models import Target
from dart_jax import profiling
from dart_jax.profiling import PhaseTimer, no_wrap
from dart_jax.tree import DARTreeConfig
from tests.helpers import TARGETS

PHASES = ("search", "verify", "accept", "draft")


def _toy_round(x, *, scale, wrap=no_wrap, traces=None):
  """Two phases; ``traces`` counts how often each is traced (compiled)."""

  def double(v):
    traces.append("double")
    return 2 * v

  def shift(v, s):
    traces.append("shift")
    return v + s

  y = wrap("double", double)(x)
  return wrap("shift", functools.partial(shift, s=scale))(y)


def test_phase_timer_compiles_each_phase_once_per_configuration():
  traces = []
  timer = PhaseTimer()
  x = jnp.arange(3.0)
  for _ in range(3):  # new partials every call, one compile per phase
    out = _toy_round(x, scale=1.0, wrap=timer.wrap(_toy_round, 1.0), traces=traces)
    np.testing.assert_allclose(np.asarray(out), [1.0, 3.0, 5.0], rtol=0, atol=0)
  assert sorted(traces) == ["double", "shift"]
  assert set(timer.seconds) == {"double", "shift"}
  assert all(s > 0 for s in timer.seconds.values())
  # Another static configuration compiles its own phases.
  out = _toy_round(x, scale=5.0, wrap=timer.wrap(_toy_round, 5.0), traces=traces)
  np.testing.assert_allclose(np.asarray(out), [5.0, 7.0, 9.0], rtol=0, atol=0)
  assert sorted(traces) == ["double", "double", "shift", "shift"]
  # Timers share compiled phases but not seconds.
  other = PhaseTimer()
  _toy_round(x, scale=1.0, wrap=other.wrap(_toy_round, 1.0), traces=traces)
  assert len(traces) == 4 and set(other.seconds) == {"double", "shift"}
  # Unwrapped, the phases are plain calls (traced eagerly every time).
  _toy_round(x, scale=1.0, traces=traces)
  assert len(traces) == 6


@pytest.fixture(scope="module")
def tiny_dartree():
  config = dataclasses.replace(TARGETS["llama"], num_layers=2)
  target = Target.init(config, seed=2)
  domino = dj.DFlashDrafter.init(target, block_size=4, num_layers=1, domino=True, seed=4)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 97, rng.integers(1, 12)).tolist() for _ in range(4)]
  return target, domino, prompts


def test_dartree_profiled_generation_equals_the_fused_round(tiny_dartree):
  target, domino, prompts = tiny_dartree
  kwargs = dict(max_new_tokens=20, draft=domino, tree="dartree",
                tree_config=DARTreeConfig(topk=4, supertree_width=3, budget=8),
                eos_token_ids=())
  fused = dj.generate(target, prompts, **kwargs)
  profiled = dj.generate(target, prompts, profile=True, **kwargs)
  assert profiled.tokens == fused.tokens
  assert profiled.stats.rounds == fused.stats.rounds
  assert fused.stats.phase_s == {}
  assert set(profiled.stats.phase_s) == set(PHASES)
  assert all(s > 0 for s in profiled.stats.phase_s.values()), profiled.stats.phase_s


def test_compiled_code_is_dropped_only_near_the_map_limit(monkeypatch):
  real = profiling._read_map_counts
  cleared = []
  monkeypatch.setattr(profiling.jax, "clear_caches", lambda: cleared.append(True))
  monkeypatch.setattr(profiling, "_read_map_counts", lambda: (1000, 65530))
  assert not profiling.free_compiled_code_near_map_limit() and not cleared
  monkeypatch.setattr(profiling, "_read_map_counts", lambda: (60000, 65530))
  assert profiling.free_compiled_code_near_map_limit() and cleared == [True]
  monkeypatch.setattr(profiling, "_read_map_counts", lambda: None)  # no /proc
  assert not profiling.free_compiled_code_near_map_limit()
  counts = real()
  assert counts is None or 0 < counts[0] < counts[1]
