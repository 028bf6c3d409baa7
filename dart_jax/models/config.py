"""Target model configuration, parsed from HF ``config.json`` dictionaries."""

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from dart_jax.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "mixtral")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (``rope_type="llama3"``)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer (Llama family, Qwen3, and their MoE variants).

  Mixture of experts (Qwen3-MoE, Mixtral): the layers in ``sparse_layers`` replace
  their MLP by ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, of which
  a softmax router picks ``num_experts_per_tok`` per token (weights renormalised
  over the chosen ones when ``norm_topk_prob``); other layers keep the dense MLP of
  ``intermediate_size``. ``num_experts=0`` is a dense model.
  """

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
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  sparse_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.arch not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(f"unsupported architecture {self.arch!r}; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")
    if self.num_experts or self.sparse_layers:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                          f"[1, num_experts={self.num_experts}]")
      if self.moe_intermediate_size < 1:
        raise ConfigError(f"moe_intermediate_size must be >= 1, got "
                          f"{self.moe_intermediate_size}")
      bad = [i for i in self.sparse_layers if not 0 <= i < self.num_layers]
      if bad or not self.num_experts:
        raise ConfigError(f"sparse_layers {list(self.sparse_layers)} must name layers "
                          f"of [0, {self.num_layers}) of a model with experts")

  def is_sparse(self, layer: int) -> bool:
    """Whether layer ``layer``'s MLP is the mixture of experts."""
    return layer in self.sparse_layers

  @property
  def dart_tap_layers(self) -> tuple[int, int, int]:
    """Layers whose INPUTS feed a DART / EAGLE-3 head: 2, L//2, L-3."""
    n = self.num_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))


_ARCH_BY_HF_NAME = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_ARCH_BY_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3",
                       "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}
# Router options of other MoE families, with the value that means "as Qwen3-MoE /
# Mixtral route"; any other value is an architecture we do not implement.
_ROUTER_DEFAULTS = {"scoring_func": "softmax", "topk_method": "greedy",
                    "routed_scaling_factor": 1.0, "n_shared_experts": 0,
                    "shared_expert_intermediate_size": 0, "n_group": 1, "topk_group": 1,
                    "moe_layer_freq": 1, "first_k_dense_replace": 0}


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
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **_moe_fields(arch, hf),
    )
  except KeyError as e:
    raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from e


def _moe_fields(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
  """The MoE fields of ``ModelConfig`` from a Qwen3-MoE or Mixtral config.

  Qwen3-MoE: layer i is sparse unless it is in ``mlp_only_layers`` or
  ``(i + 1) % decoder_sparse_step != 0``; ``norm_topk_prob`` as configured.
  Mixtral: every layer is sparse, experts of ``intermediate_size``, weights always
  renormalised. Both accept ``num_experts`` or ``num_local_experts``.
  """
  if arch not in ("qwen3_moe", "mixtral"):
    return {}
  for key, neutral in _ROUTER_DEFAULTS.items():
    value = hf.get(key)
    if value is not None and value != neutral:
      raise ConfigError(f"unsupported MoE router option {key}={value!r} (supported: "
                        f"{key}={neutral!r}, as Qwen3-MoE and Mixtral route)")
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise ConfigError("MoE config.json names no experts (num_experts / "
                      "num_local_experts)")
  num_layers = int(hf["num_hidden_layers"])
  norm = hf.get("norm_topk_prob", arch == "mixtral")
  if not isinstance(norm, bool):
    raise ConfigError(f"norm_topk_prob must be true or false, got {norm!r}")
  if arch == "mixtral":
    window = hf.get("sliding_window")
    if window is not None and int(window) < int(hf.get("max_position_embeddings", 4096)):
      raise ConfigError(f"sliding_window={window} (attention limited to the last "
                        f"{window} tokens) is not supported; dart-jax attends to the "
                        "whole context")
    return dict(num_experts=int(num_experts),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                sparse_layers=tuple(range(num_layers)))
  step = int(hf.get("decoder_sparse_step", 1))
  if step < 1:
    raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
  dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
  sparse = tuple(i for i in range(num_layers)
                 if i not in dense and int(num_experts) > 0 and (i + 1) % step == 0)
  return dict(num_experts=int(num_experts),
              num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
              moe_intermediate_size=int(hf["moe_intermediate_size"]),
              norm_topk_prob=norm, sparse_layers=sparse)


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
