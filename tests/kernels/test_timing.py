"""kernels.timing: one untimed call, then one duration per timed call."""

import jax.numpy as jnp

from kernels import timing


def test_time_calls_warms_up_once_and_times_each_call():
  calls = []

  def fn(x):
    calls.append(1)
    return x + 1

  times = timing.time_calls(fn, (jnp.ones(3),), reps=4)
  assert len(times) == 4 and len(calls) == 5
  assert all(t >= 0 for t in times)
