"""Shared test fixtures."""

import atexit
import os
import shutil
import tempfile

# The suite's time is mostly XLA compilation of many small programs; LLVM's
# optimisation level changes compile time, not results. Set before jax loads.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import dart_jax as dj  # pylint: disable=wrong-import-position

_XLA_CACHE_ENV = "DART_JAX_TEST_XLA_CACHE"


def _use_a_compilation_cache_for_the_run() -> None:
  """Keeps compiled programs on disk for one test run. Many modules compile the
  same programs (the tiny targets' prefill and rounds), and the in-memory cache
  is dropped after each module (below); with the disk cache a program compiles
  once per run, also across pytest-xdist workers. The process that starts the run
  (the xdist controller, or the only process) makes the folder and removes it at
  exit; workers inherit its path. Set DART_JAX_TEST_XLA_CACHE to keep one."""
  path = os.environ.get(_XLA_CACHE_ENV)
  if not path:
    path = tempfile.mkdtemp(prefix="dart_jax_xla_cache_")
    os.environ[_XLA_CACHE_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_use_a_compilation_cache_for_the_run()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """XLA:CPU maps the code of every compiled program into the process; the
  suite compiles thousands, and past the kernel's per-process map limit
  (vm.max_map_count, 65530 by default) a compile segfaults. Dropping JAX's
  caches after each test module lets the programs be freed."""
  yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
  """The embedded default target, converted into a fresh cache dir (as a new user
  gets it). Session-scoped: loading SmolLM2 costs seconds."""
  mp = pytest.MonkeyPatch()
  mp.setenv("DART_JAX_CACHE", str(tmp_path_factory.mktemp("dart_jax_cache")))
  try:
    return dj.load_target()
  finally:
    mp.undo()


@pytest.fixture(scope="session")
def smollm2_float32(smollm2):
  """The embedded target in the exact float32 mode (parity with transformers),
  from the directory the ``smollm2`` fixture converted."""
  return dj.load_target(smollm2.source, dtype="float32")
