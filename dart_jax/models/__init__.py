"""Target transformers (Llama, Qwen3), the KV cache, and loading."""

from dart_jax.models import precision
from dart_jax.models.config import ModelConfig, RopeScaling, config_from_hf
from dart_jax.models.precision import Precision
from dart_jax.models.target import Target, load_target
from dart_jax.models.transformer import KVCache, ModelOutput, Transformer, causal_mask

__all__ = ["ModelConfig", "Precision", "RopeScaling", "config_from_hf", "Target", "load_target",
           "precision", "KVCache", "ModelOutput", "Transformer", "causal_mask"]
