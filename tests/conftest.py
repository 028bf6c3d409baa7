"""Shared test fixtures."""

import pytest

import dart_jax as dj


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
