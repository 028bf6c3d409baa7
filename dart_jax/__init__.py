"""dart-jax: lossless speculative decoding (DART, DARTree) in JAX."""

from dart_jax.errors import CheckpointError, ConfigError, DartJaxError, InputError
from dart_jax.models import ModelConfig, Target, load_target

__version__ = "0.1.0"
