"""Wall-clock timing of compiled calls, shared by the benchmarks."""

import time
from typing import Any, Callable

import jax


def time_calls(fn: Callable, args: tuple[Any, ...], reps: int) -> list[float]:
  """Seconds of ``reps`` calls of ``fn(*args)``, each waited for; one untimed call
  first (compilation, warm caches)."""
  jax.block_until_ready(fn(*args))
  out = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append(time.perf_counter() - start)
  return out
