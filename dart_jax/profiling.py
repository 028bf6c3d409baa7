"""Profile mode of the speculative decoders: a round split into timed phases.

A decoder's round function takes ``wrap(name, fn)`` and calls every phase as
``wrap(name, fn)(*arrays)``. Normal decoding passes ``no_wrap`` (the phases
fuse into one compiled round); profile mode passes ``PhaseTimer.wrap(...)``,
which compiles each phase on its own and accumulates its wall seconds.
"""

import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

# wrap(name, fn) -> the function the round calls in place of fn.
Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]

# Compiled phases by (phase name, static configuration). Module-wide because a
# round builds new ``functools.partial`` phases every call and each decoder
# lives for one ``generate`` call: keying jit by value compiles each once.
_COMPILED: dict[tuple[str, Hashable], Callable[..., Any]] = {}


def no_wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
  """The default ``wrap``: phases run as they are, fused into the round."""
  del name
  return fn


class PhaseTimer:
  """Runs phases as separately compiled calls; ``seconds`` sums each phase's
  wall time (dispatch to ``block_until_ready``) over all calls."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def wrap(self, *config: Hashable) -> Wrap:
    """A ``wrap`` for one round call.

    config: everything static the phases close over (graphdefs, static
    arguments), and the round function itself so that two decoders' phases of
    the same name never share a compiled function.
    """

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
      key = (name, config)
      if key not in _COMPILED:
        _COMPILED[key] = jax.jit(fn)
      compiled = _COMPILED[key]

      def run(*args):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out

      return run

    return timed
