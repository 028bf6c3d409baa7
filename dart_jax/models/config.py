"""Target model configuration, parsed from HF ``config.json`` dictionaries."""

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from dart_jax.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (``rope_type="llama3"``)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer (Llama family, Qwen3)."""

  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_embeddings: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k.
  attention_bias: bool = False
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.arch not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(f"unsupported architecture {self.arch!r}; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")

  @property
  def dart_tap_layers(self) -> tuple[int, int, int]:
    """Layers whose INPUTS feed a DART / EAGLE-3 head: 2, L//2, L-3."""
    n = self.num_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))


_ARCH_BY_HF_NAME = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """Reads theta and scaling from classic or ``rope_parameters`` configs."""
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  theta = hf.get("rope_theta")
  if isinstance(params, Mapping):
    theta = params.get("rope_theta", theta)
    scaling = params
  theta = 10000.0 if theta is None else float(theta)
  if not scaling:
    return theta, None
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"unsupported rope scaling type {rope_type!r}; supported: "
                      "default, llama3")
  return theta, RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(
          scaling["original_max_position_embeddings"]),
  )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """Builds a ``ModelConfig`` from a HF ``config.json`` dictionary."""
  archs = hf.get("architectures") or []
  arch = next((_ARCH_BY_HF_NAME[a] for a in archs if a in _ARCH_BY_HF_NAME), None)
  if arch is None:
    arch = _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""))
  if arch is None:
    raise ConfigError(
        f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
        f"{', '.join(_ARCH_BY_HF_NAME)}")
  try:
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (
        () if eos is None else (int(eos),))
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
  except KeyError as e:
    raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from e


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse RoPE frequencies [head_dim // 2], Llama-3 scaling applied."""
  inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if scaling is None:
    return inv.astype(np.float32)
  s = scaling
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  scaled = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
  return scaled.astype(np.float32)
