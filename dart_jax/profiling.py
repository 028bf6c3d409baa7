"""Timing helpers: the decoders' profile mode and compile detection.

Profile mode: a decoder's round function takes ``wrap(name, fn)`` and calls every
phase as ``wrap(name, fn)(*arrays)``. Normal decoding passes ``no_wrap`` (the
phases fuse into one compiled round); profile mode passes ``PhaseTimer.wrap(...)``,
which compiles each phase on its own and accumulates its wall seconds.

``CompileWatch`` collects the XLA compilations inside a ``with`` block, so that
``generate`` can report how much of a call's decode time was compiling and the
benchmark can discard runs that compiled.
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


PREFILL_FUNCTIONS = ("prefill", "speculative_prefill")
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# The stages of turning a function into an executable: tracing, lowering, XLA.
_COMPILE_STAGES = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration", _BACKEND_COMPILE)
# The open watches, innermost last: (stage, function name, seconds) per event.
_compile_logs: list[list[tuple[str, str, float]]] = []
_listening = False


def _on_event(event: str, duration: float, **kwargs) -> None:
  if _compile_logs and event in _COMPILE_STAGES:
    for log in _compile_logs:
      log.append((event, str(kwargs.get("fun_name", "")), duration))


def _is_prefill(name: str) -> bool:
  """Whether a compiled function's name ("f", "jit(f)" or "jit_f") is a prefill."""
  base = name.removeprefix("jit(").removesuffix(")").removeprefix("jit_")
  return base in PREFILL_FUNCTIONS


class CompileWatch:
  """Collects JAX compilations inside a ``with`` block (nestable).

  ``decode_compiles``: (function name, seconds) of each XLA compilation of anything
  but the prefill functions (the prefill is outside decode time, the rest is not).
  ``decode_compile_s``: their seconds with tracing and lowering included.
  """

  def __enter__(self) -> "CompileWatch":
    global _listening
    if not _listening:
      jax.monitoring.register_event_duration_secs_listener(_on_event)
      _listening = True
    self.events: list[tuple[str, str, float]] = []
    _compile_logs.append(self.events)
    return self

  def __exit__(self, *exc) -> None:
    index = next(i for i, log in enumerate(_compile_logs) if log is self.events)
    del _compile_logs[index]

  @property
  def decode_compiles(self) -> list[tuple[str, float]]:
    return [(name, d) for stage, name, d in self.events
            if stage == _BACKEND_COMPILE and not _is_prefill(name)]

  @property
  def decode_compile_s(self) -> float:
    return sum(d for _, name, d in self.events if not _is_prefill(name))


def _read_map_counts() -> tuple[int, int] | None:
  """(memory maps of this process, the kernel's per-process limit), or None
  where /proc does not tell (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return used, int(f.read())
  except (OSError, ValueError):
    return None


def free_compiled_code_near_map_limit(fraction: float = 0.75) -> bool:
  """Drops JAX's compiled programs when this process nears its memory-map limit.

  XLA:CPU maps the code of every compiled program into the process (about 5
  maps for a tiny one, many more for a model round); a long run that compiles
  many methods and shapes (``infer.bench --profile`` over every method) can
  pass ``vm.max_map_count``, and the next compile then fails with "LLVM
  compilation error: Cannot allocate memory". Past ``fraction`` of the limit
  this clears the caches (programs recompile when next used) and returns True.
  """
  counts = _read_map_counts()
  if counts is None or counts[0] < fraction * counts[1]:
    return False
  jax.clear_caches()
  _COMPILED.clear()
  return True


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
