"""HF safetensors directories: reading, sharding, bf16, and bad inputs."""

import json
import pathlib
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from dart_jax.errors import CheckpointError
from dart_jax.io import read_safetensors_dir, write_safetensors_dir
from dart_jax.io import safetensors_io

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "model.embed_tokens.weight": rng.standard_normal((5, 8)).astype(np.float32),
      "model.norm.weight": rng.standard_normal(8).astype(np.float32),
      "lm_head.weight": rng.standard_normal((5, 8)).astype(np.float32),
  }


def _write_raw_safetensors(path: pathlib.Path,
                           entries: dict[str, tuple[str, list[int], bytes]]):
  """Writes a safetensors file by hand: u64 header size, JSON header, data."""
  header, blob = {}, b""
  for name, (dtype, shape, data) in entries.items():
    header[name] = {"dtype": dtype, "shape": shape,
                    "data_offsets": [len(blob), len(blob) + len(data)]}
    blob += data
  raw_header = json.dumps(header).encode()
  raw_header += b" " * (-len(raw_header) % 8)
  path.write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + blob)


def _bf16_bytes(values: np.ndarray) -> bytes:
  """float32 values that are exact in bf16 -> their bf16 bytes (top halves)."""
  bits = values.astype(np.float32).view(np.uint32)
  assert np.all(bits & 0xFFFF == 0), "test values must be exact in bf16"
  return (bits >> 16).astype(np.uint16).tobytes()


def test_write_then_read_round_trip(tmp_path):
  tensors = _tensors()
  write_safetensors_dir(tmp_path / "m", CONFIG, tensors)
  config, loaded = read_safetensors_dir(tmp_path / "m")
  assert config == CONFIG
  assert loaded.keys() == tensors.keys()
  for name, array in tensors.items():
    np.testing.assert_array_equal(loaded[name], array)
    assert loaded[name].dtype == np.float32


def test_bf16_file_reads_as_float32(tmp_path):
  # Values with at most 8 significant bits are exact in bf16.
  values = np.array([[1.0, -2.5, 0.15625], [3.0e8, -1.0e-3, 0.0]], np.float32)
  values = (values.view(np.uint32) & 0xFFFF0000).view(np.float32)
  (tmp_path / "config.json").write_text(json.dumps(CONFIG))
  _write_raw_safetensors(tmp_path / "model.safetensors",
                         {"w": ("BF16", [2, 3], _bf16_bytes(values)),
                          "h": ("F16", [3], np.array([1, 2, 3], np.float16).tobytes())})
  _, loaded = read_safetensors_dir(tmp_path)
  assert loaded["w"].dtype == np.float32 and loaded["h"].dtype == np.float32
  np.testing.assert_array_equal(loaded["w"], values)
  np.testing.assert_array_equal(loaded["h"], [1.0, 2.0, 3.0])
  # The raw-header fallback (for safetensors without numpy bf16) agrees.
  raw = safetensors_io._read_raw_tensors(tmp_path / "model.safetensors")
  np.testing.assert_array_equal(raw["w"], values)
  np.testing.assert_array_equal(raw["h"], np.array([1, 2, 3], np.float16))
  # dtype=None keeps the stored dtype.
  _, kept = read_safetensors_dir(tmp_path, dtype=None)
  assert kept["w"].dtype.name == "bfloat16"
  np.testing.assert_array_equal(kept["w"].astype(np.float32), values)


def _write_sharded(directory: pathlib.Path, tensors, index_map=None):
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps(CONFIG))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[:2],
            "model-00002-of-00002.safetensors": names[2:]}
  weight_map = {}
  for shard, shard_names in shards.items():
    save_file({n: tensors[n] for n in shard_names}, str(directory / shard))
    weight_map.update({n: shard for n in shard_names})
  index = {"metadata": {}, "weight_map": index_map or weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))
  return weight_map


def test_sharded_directory_with_index(tmp_path):
  tensors = _tensors(1)
  _write_sharded(tmp_path / "m", tensors)
  _, loaded = read_safetensors_dir(tmp_path / "m")
  assert loaded.keys() == tensors.keys()
  for name, array in tensors.items():
    np.testing.assert_array_equal(loaded[name], array)


def test_index_naming_a_missing_shard(tmp_path):
  tensors = _tensors(2)
  weight_map = _write_sharded(tmp_path / "m", tensors)
  (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
    read_safetensors_dir(tmp_path / "m")
  assert weight_map  # The index did name it.


def test_index_listing_a_tensor_no_shard_has(tmp_path):
  tensors = _tensors(3)
  directory = tmp_path / "m"
  weight_map = _write_sharded(directory, tensors)
  weight_map["model.layers.0.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
  (directory / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": weight_map}))
  with pytest.raises(CheckpointError, match="up_proj"):
    read_safetensors_dir(directory)


def test_tensor_in_two_shards(tmp_path):
  directory = tmp_path / "m"
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps(CONFIG))
  a = np.ones(2, np.float32)
  save_file({"x": a}, str(directory / "a.safetensors"))
  save_file({"x": a}, str(directory / "b.safetensors"))
  with pytest.raises(CheckpointError, match="more than one shard"):
    read_safetensors_dir(directory)


def test_shards_without_index_are_all_read(tmp_path):
  directory = tmp_path / "m"
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps(CONFIG))
  save_file({"x": np.ones(2, np.float32)}, str(directory / "part-1.safetensors"))
  save_file({"y": np.zeros(3, np.float32)}, str(directory / "part-2.safetensors"))
  _, loaded = read_safetensors_dir(directory)
  assert sorted(loaded) == ["x", "y"]
  np.testing.assert_array_equal(loaded["y"], np.zeros(3))


def test_missing_path(tmp_path):
  missing = tmp_path / "no_such_model"
  with pytest.raises(CheckpointError, match="does not exist") as info:
    read_safetensors_dir(missing)
  assert str(missing) in str(info.value)


def test_path_is_a_file(tmp_path):
  file = tmp_path / "model.safetensors"
  file.write_bytes(b"x")
  with pytest.raises(CheckpointError, match="not a directory"):
    read_safetensors_dir(file)


def test_directory_without_config(tmp_path):
  save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match="config.json") as info:
    read_safetensors_dir(tmp_path)
  assert str(tmp_path / "config.json") in str(info.value)


def test_invalid_config_json(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match="not valid JSON"):
    read_safetensors_dir(tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(CheckpointError, match="JSON object"):
    read_safetensors_dir(tmp_path)


def test_directory_without_weights(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(CONFIG))
  with pytest.raises(CheckpointError, match="no safetensors weights"):
    read_safetensors_dir(tmp_path)


def test_corrupt_safetensors(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(CONFIG))
  (tmp_path / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors file")
  with pytest.raises(CheckpointError, match="model.safetensors"):
    read_safetensors_dir(tmp_path)


def test_truncated_safetensors(tmp_path):
  write_safetensors_dir(tmp_path, CONFIG, _tensors())
  file = tmp_path / "model.safetensors"
  file.write_bytes(file.read_bytes()[:-17])
  with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
    read_safetensors_dir(tmp_path)
  assert str(file) in str(info.value)
