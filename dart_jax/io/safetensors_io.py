"""HF checkpoint directories: ``config.json`` + ``*.safetensors`` (+ index).

Tensors come back as numpy arrays keyed by their HF names. Floating tensors are
cast to float32 by default (bf16 / fp16 checkpoints included); the caller casts
again to the compute dtype when it builds the model.
"""

import json
import os
import pathlib
import struct
from typing import Any, Mapping

import numpy as np

from dart_jax.errors import CheckpointError

CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Raw-header fallback for safetensors versions whose numpy API lacks bf16:
# dtype tag -> numpy dtype (BF16 is handled separately).
_RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
}


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
  """bf16 stored as uint16 -> float32 (bf16 is the top half of a float32)."""
  return (bits.astype(np.uint32) << 16).view(np.float32)


def read_json(path: pathlib.Path, what: str) -> dict[str, Any]:
  """Reads a JSON object file, raising CheckpointError that names the file."""
  if not path.is_file():
    raise CheckpointError(f"{what} not found: {path}")
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise CheckpointError(f"{what} {path} must hold a JSON object, got "
                          f"{type(value).__name__}")
  return value


def _read_raw_tensors(path: pathlib.Path, names: list[str] | None = None
                      ) -> dict[str, np.ndarray]:
  """Reads tensors from a safetensors file by parsing its header directly.

  Used only when the installed safetensors cannot give a dtype to numpy.
  """
  with open(path, "rb") as f:
    blob = f.read()
  if len(blob) < 8:
    raise CheckpointError(f"{path} is too short to be a safetensors file")
  (header_len,) = struct.unpack("<Q", blob[:8])
  if 8 + header_len > len(blob):
    raise CheckpointError(f"{path}: header length {header_len} runs past the end "
                          f"of the file ({len(blob)} bytes): truncated or corrupt")
  header = json.loads(blob[8:8 + header_len])
  header.pop("__metadata__", None)
  data = memoryview(blob)[8 + header_len:]
  out = {}
  for name, info in header.items():
    if names is not None and name not in names:
      continue
    start, end = info["data_offsets"]
    if end > len(data):
      raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the "
                            "file: truncated or corrupt")
    dtype = info["dtype"]
    if dtype == "BF16":
      array = _bf16_bits_to_float32(np.frombuffer(data[start:end], np.uint16))
    elif dtype in _RAW_DTYPES:
      array = np.frombuffer(data[start:end], _RAW_DTYPES[dtype]).copy()
    else:
      raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    out[name] = array.reshape(info["shape"])
  return out


def _cast(array: np.ndarray, dtype: Any) -> np.ndarray:
  """Casts floating tensors (bf16 included) to ``dtype``; others unchanged."""
  is_float = np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"
  if dtype is None or not is_float:
    return array
  return np.asarray(array, dtype=dtype)


def read_safetensors_file(path: pathlib.Path, dtype: np.dtype | None
                          ) -> dict[str, np.ndarray]:
  """All tensors of one ``.safetensors`` file as numpy arrays."""
  import safetensors  # Lazy: keeps `import dart_jax` light.

  tensors = {}
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      names = list(f.keys())
      for name in names:
        try:
          tensors[name] = _cast(f.get_tensor(name), dtype)
        except (TypeError, ValueError) as e:
          # Old safetensors without ml_dtypes: no numpy bf16. Parse raw bytes.
          if "bf16" not in str(e).lower() and "bfloat16" not in str(e).lower():
            raise
          raw = _read_raw_tensors(path, [name])[name]
          tensors[name] = raw if dtype is None else raw.astype(dtype)
  except CheckpointError:
    raise
  except Exception as e:  # safetensors raises its own SafetensorError type.
    raise CheckpointError(f"cannot read safetensors file {path}: {e} (the file is "
                          "corrupt or truncated; download or convert it again)") from e
  return tensors


class LazyTensor:
  """One tensor of a ``.safetensors`` file, read slice by slice on demand.

  ``tensor[index]`` reads only that slice (memory-mapped), cast like
  ``read_safetensors_file``; ``np.asarray(tensor)`` reads it all. Sharded
  loading hands each device its slice this way, so no host or device holds
  the whole model at once.
  """

  def __init__(self, path: pathlib.Path, name: str, shape: tuple[int, ...], dtype: Any):
    self.path, self.name, self.shape, self.dtype = path, name, tuple(shape), dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index) -> np.ndarray:
    import safetensors

    try:
      with safetensors.safe_open(str(self.path), framework="numpy") as f:
        piece = f.get_slice(self.name)[index]
    except Exception as e:
      raise CheckpointError(f"cannot read tensor {self.name!r} of {self.path}: {e} (the "
                            "file is corrupt or truncated)") from e
    return _cast(np.asarray(piece), self.dtype)

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    array = self[tuple(slice(None) for _ in self.shape)]
    return array if dtype is None else array.astype(dtype)


def lazy_safetensors_file(path: pathlib.Path, dtype: Any) -> dict[str, LazyTensor]:
  """The tensors of one ``.safetensors`` file as ``LazyTensor`` (header only)."""
  import safetensors

  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      return {name: LazyTensor(path, name, tuple(f.get_slice(name).get_shape()), dtype)
              for name in f.keys()}
  except Exception as e:
    raise CheckpointError(f"cannot read safetensors file {path}: {e} (the file is "
                          "corrupt or truncated; download or convert it again)") from e


def _shard_files(directory: pathlib.Path) -> tuple[list[pathlib.Path], set[str] | None]:
  """Safetensors files to read, and the tensor names the index promises."""
  index_path = directory / INDEX_NAME
  if index_path.exists():
    index = read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index_path} has no 'weight_map' of tensor -> shard")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
      raise CheckpointError(
          f"{index_path} names shard(s) that are missing: "
          f"{', '.join(str(directory / s) for s in missing)}; copy or download them "
          "again")
    return [directory / s for s in shards], set(weight_map)
  single = directory / SINGLE_FILE_NAME
  if single.is_file():
    return [single], None
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise CheckpointError(
        f"no safetensors weights in {directory}: expected {SINGLE_FILE_NAME}, or "
        f"shards with {INDEX_NAME}")
  return files, None


def read_safetensors_dir(path: str | os.PathLike, dtype: Any = np.float32, *,
                         lazy: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Reads a HF checkpoint directory.

  Args:
    path: directory with ``config.json`` and ``model.safetensors``, or sharded
      ``*.safetensors`` files with ``model.safetensors.index.json``.
    dtype: floating tensors are cast to this (default float32); None keeps the
      stored dtype (bf16 then comes back as ``ml_dtypes.bfloat16``).
    lazy: return ``LazyTensor`` objects that read slices on demand (sharded
      loading) instead of numpy arrays.

  Returns:
    (hf_config, tensors): the ``config.json`` dictionary and numpy tensors by
    HF name, e.g. ``model.layers.0.self_attn.q_proj.weight: [out, in]``.
  """
  directory = pathlib.Path(path).expanduser()
  if not directory.exists():
    raise CheckpointError(f"checkpoint path does not exist: {directory}")
  if not directory.is_dir():
    raise CheckpointError(f"checkpoint path is not a directory: {directory} (pass "
                          "the folder holding config.json and *.safetensors)")
  hf_config = read_json(directory / CONFIG_NAME, "config.json")
  files, promised = _shard_files(directory)
  tensors: dict[str, np.ndarray] = {}
  for file in files:
    read = lazy_safetensors_file if lazy else read_safetensors_file
    for name, array in read(file, dtype).items():
      if name in tensors:
        raise CheckpointError(f"tensor {name!r} appears in more than one shard "
                              f"(again in {file})")
      tensors[name] = array
  if promised is not None:
    lost = sorted(promised - set(tensors))
    if lost:
      raise CheckpointError(
          f"{directory / INDEX_NAME} lists {len(lost)} tensor(s) not found in the "
          f"shards, e.g. {lost[:3]}; the shards do not match the index")
  return hf_config, tensors


def write_safetensors_dir(path: str | os.PathLike, hf_config: Mapping[str, Any],
                          tensors: Mapping[str, np.ndarray]) -> pathlib.Path:
  """Writes ``config.json`` + a single ``model.safetensors`` into ``path``."""
  from safetensors.numpy import save_file

  directory = pathlib.Path(path).expanduser()
  directory.mkdir(parents=True, exist_ok=True)
  with open(directory / CONFIG_NAME, "w", encoding="utf-8") as f:
    json.dump(dict(hf_config), f, indent=2, sort_keys=True)
    f.write("\n")
  # "format": "pt" lets transformers load the directory too.
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(directory / SINGLE_FILE_NAME), metadata={"format": "pt"})
  return directory
