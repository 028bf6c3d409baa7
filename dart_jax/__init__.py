"""dart-jax: lossless speculative decoding (DART, DARTree) in JAX.

    import dart_jax as dj
    target = dj.load_target()                 # embedded SmolLM2-135M-Instruct
    out = dj.generate(target, "Hello", max_new_tokens=64)
    head = dj.load_dart()                     # the DART head shipped for it
    out = dj.generate(target, "Hello", method=dj.DART(head, dj.load_ngram()))
    out = dj.generate(target, "Hello", draft=head, ngram=dj.load_ngram())  # the same
    head = dj.load_dart("/path/to/dart_dir", target)   # any reference-format head
"""

from dart_jax import ngram, sharding, tree
from dart_jax.decode.methods import DART, DARTree, DartGru
from dart_jax.draft.dart_gru import DartGruDrafter, load_dart_gru, save_dart_gru
from dart_jax.draft.dart_head import DartConfig, DartHead, load_dart, save_dart
from dart_jax.draft.dflash import DFlashDrafter, load_dflash, load_domino, save_dflash
from dart_jax.errors import CheckpointError, ConfigError, DartJaxError, InputError
from dart_jax.generate import GenerateOutput, GenerateStats, generate, generate_stream
from dart_jax.models import ModelConfig, Precision, Target, load_target, precision
from dart_jax.ngram import load_ngram

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "DART", "DARTree", "DFlashDrafter", "DartGru", "DartConfig", "DartGruDrafter",
    "DartHead", "DartJaxError", "GenerateOutput", "GenerateStats", "InputError",
    "ModelConfig", "Precision", "Target", "generate", "generate_stream", "load_dart",
    "load_dart_gru", "load_dflash", "load_domino", "load_ngram", "load_target", "ngram",
    "precision", "save_dart", "save_dart_gru", "save_dflash", "sharding", "tree",
]
