"""Checkpoints and tokenizers in and out: HF safetensors dirs, GGUF, tokenizers."""

from dart_jax.io.default_model import cache_dir
from dart_jax.io.default_model import convert_gguf_to_dir
from dart_jax.io.default_model import embedded_dart_dir
from dart_jax.io.default_model import embedded_dartree_config
from dart_jax.io.default_model import embedded_domino_dir
from dart_jax.io.default_model import embedded_gguf_path
from dart_jax.io.default_model import embedded_ngram_path
from dart_jax.io.default_model import embedded_tree_config
from dart_jax.io.default_model import ensure_embedded_converted
from dart_jax.io.gguf_io import read_gguf
from dart_jax.io.safetensors_io import read_safetensors_dir
from dart_jax.io.safetensors_io import write_safetensors_dir
from dart_jax.io.tokenizer import StreamDecoder
from dart_jax.io.tokenizer import Tokenizer

__all__ = [
    "StreamDecoder",
    "Tokenizer",
    "cache_dir",
    "convert_gguf_to_dir",
    "embedded_dart_dir",
    "embedded_dartree_config",
    "embedded_domino_dir",
    "embedded_gguf_path",
    "embedded_ngram_path",
    "embedded_tree_config",
    "ensure_embedded_converted",
    "read_gguf",
    "read_safetensors_dir",
    "write_safetensors_dir",
]
