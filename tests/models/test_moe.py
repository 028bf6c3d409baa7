"""Mixture-of-experts layers: routing, both expert formulations, checkpoint forms,
config parsing. (Parity with transformers: tests/models/test_hf_parity.py; losslessness of
DART / DARTree on MoE targets: the qwen3_moe target of tests/decode/test_speculative.py and
tests/decode/test_dartree_decode.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.models import Target, checkpoint, moe
from dart_jax.models.config import ModelConfig, config_from_hf
from dart_jax.models.target import hf_name, params_from_hf

CONFIG = ModelConfig(arch="qwen3_moe", vocab_size=50, hidden_size=16, intermediate_size=24,
                     num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
                     num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                     sparse_layers=(0, 2))


def _layer(impl: str, precision: str = "float32", norm: bool = True) -> moe.MoE:
  return moe.MoE(16, 12, 6, 2, norm_topk_prob=norm, rngs=nnx.Rngs(3), precision=precision,
                 expert_impl=impl)


def _numpy_moe(layer: moe.MoE, x: np.ndarray, norm: bool) -> np.ndarray:
  """The transformers computation, written out in float64."""
  e = layer.experts

  def mats(proj):  # [E, in, out]
    m = np.asarray(proj.matrices(), np.float64)
    return np.swapaxes(m, 1, 2) if proj.transposed else m

  router = np.asarray(layer.router.matrix(), np.float64)
  router = router.T if layer.router.transposed else router
  logits = x @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  gate, up, down = mats(e.gate_proj), mats(e.up_proj), mats(e.down_proj)
  for n in range(x.shape[0]):
    chosen = np.argsort(-probs[n], kind="stable")[:2]
    weights = probs[n, chosen] / (probs[n, chosen].sum() if norm else 1.0)
    for w, k in zip(weights, chosen):
      g, u = x[n] @ gate[k], x[n] @ up[k]
      out[n] += w * ((g / (1 + np.exp(-g))) * u) @ down[k]
  return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("impl", ["gather", "sorted"])
def test_both_formulations_compute_the_transformers_moe(impl, norm):
  layer = _layer(impl, norm=norm)
  x = np.random.default_rng(0).normal(size=(7, 16)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), _numpy_moe(layer, x, norm),
                             atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("precision", ["float32", "fast"])
def test_a_token_gets_the_same_output_alone_or_in_a_batch(precision):
  """Routing and expert math are per token, so verifying a tree changes nothing."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(9, 16)).astype(np.float32))
  alone = np.stack([np.asarray(_layer("gather", precision)(x[n:n + 1]))[0]
                    for n in range(9)])
  for impl in ("gather", "sorted"):  # "auto" may pick either for a batch
    together = np.asarray(_layer(impl, precision)(x))
    np.testing.assert_allclose(alone, together, atol=1e-6, rtol=1e-5)


def _reference_tensors(precision="float32"):
  target = Target.init(CONFIG, seed=1, dtype=precision)
  return target, checkpoint.tensors_from_state(target.params, hf_name)


def _per_expert(tensors, mixtral: bool):
  out = {}
  for name, array in tensors.items():
    if ".mlp.experts." in name:
      layer, proj = name.split(".mlp.experts.")
      proj = proj.removesuffix(".weight")
      for e, matrix in enumerate(array):
        if mixtral:
          w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
          out[f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = matrix
        else:
          out[f"{layer}.mlp.experts.{e}.{proj}.weight"] = matrix
    elif name.endswith(".mlp.gate.weight") and mixtral:
      out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = array
    else:
      out[name] = array
  return out


def _fused(tensors):
  out = dict(tensors)
  for layer in CONFIG.sparse_layers:
    prefix = f"model.layers.{layer}.mlp.experts."
    gate, up = out.pop(prefix + "gate_proj.weight"), out.pop(prefix + "up_proj.weight")
    out[prefix + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
    out[prefix + "down_proj"] = out.pop(prefix + "down_proj.weight")
  return out


@pytest.mark.parametrize("form", ["per_expert", "mixtral_names", "fused"])
def test_every_released_expert_layout_loads_the_same_model(form):
  target, tensors = _reference_tensors()
  released = {"per_expert": lambda t: _per_expert(t, False),
              "mixtral_names": lambda t: _per_expert(t, True), "fused": _fused}[form](tensors)
  assert not set(released) & {n for n in tensors if ".mlp.experts." in n}
  _, params = params_from_hf(CONFIG, released, "float32", source="test")
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(target.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fast_mode_stores_expert_weights_out_in():
  _, tensors = _reference_tensors()
  fast, _ = _reference_tensors("fast")
  gate = fast.params["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"][...]
  assert gate.shape == (6, 12, 16) and gate.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(gate, np.float32),
      np.asarray(jnp.asarray(tensors["model.layers.0.mlp.experts.gate_proj.weight"],
                             jnp.bfloat16), np.float32))


def test_missing_expert_is_a_clear_error():
  _, tensors = _reference_tensors()
  released = _per_expert(tensors, False)
  del released["model.layers.2.mlp.experts.4.up_proj.weight"]
  with pytest.raises(CheckpointError, match="layer 2 has no expert 4 up_proj"):
    params_from_hf(CONFIG, released, "float32", source="test")


def _hf_config(**overrides):
  hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 50, "hidden_size": 16,
        "intermediate_size": 24, "moe_intermediate_size": 12, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "mlp_only_layers": [3]}
  hf.update(overrides)
  return hf


def test_config_sparse_layers_and_key_spellings():
  c = config_from_hf(_hf_config())
  assert c.sparse_layers == (1,) and not c.norm_topk_prob  # (i+1) % 2 == 0, 3 dense
  assert c.qk_norm and c.moe_intermediate_size == 12 and c.intermediate_size == 24
  mixtral = config_from_hf({"architectures": ["MixtralForCausalLM"], "vocab_size": 50,
                            "hidden_size": 16, "intermediate_size": 24,
                            "num_hidden_layers": 2, "num_attention_heads": 2,
                            "num_local_experts": 4, "num_experts_per_tok": 2,
                            "rope_parameters": {"rope_type": "default",
                                                "rope_theta": 1e6}})
  assert (mixtral.num_experts, mixtral.sparse_layers, mixtral.norm_topk_prob) == (
      4, (0, 1), True)
  assert mixtral.moe_intermediate_size == 24 and mixtral.rope_theta == 1e6


@pytest.mark.parametrize("overrides,match", [
    (dict(scoring_func="sigmoid"), "unsupported MoE router option scoring_func"),
    (dict(topk_method="group_limited_greedy"), "router option topk_method"),
    (dict(n_shared_experts=2), "router option n_shared_experts"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    (dict(num_experts_per_tok=7), r"num_experts_per_tok=7 must be in \[1, num_experts=6\]"),
    (dict(num_experts=None), "names no experts"),
])
def test_bad_moe_configs_are_clear_errors(overrides, match):
  hf = _hf_config(**overrides)
  if overrides.get("num_experts", 0) is None:
    del hf["num_experts"]
  with pytest.raises(ConfigError, match=match):
    config_from_hf(hf)


def test_mixtral_sliding_window_is_a_clear_error():
  hf = {"architectures": ["MixtralForCausalLM"], "vocab_size": 50, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "sliding_window": 4096}
  with pytest.raises(ConfigError, match="sliding_window=4096"):
    config_from_hf(hf)
  hf["sliding_window"] = None
  assert config_from_hf(hf).num_experts == 4


def test_bad_model_config_is_a_clear_error():
  with pytest.raises(ConfigError, match="sparse_layers"):
    dataclasses.replace(CONFIG, sparse_layers=(0, 3))


def test_moe_bench_times_every_cell():
  from dart_jax.models import precision
  from infer import moe_bench

  base = dataclasses.replace(CONFIG, num_layers=2, sparse_layers=(0, 1))
  lines = []
  results = moe_bench.measure([2, 4], [1, 3], precision.resolve("float32"),
                              ["gather", "sorted"], reps=1, base=base, log=lines.append)
  assert sorted(results["ms"]) == ["gather/T=1", "gather/T=3", "sorted/T=1", "sorted/T=3"]
  for cell in results["ms"].values():
    assert cell["2"] > 0 and cell["4"] > 0
    # Both sides are rounded to 3 decimals; a one-rep timing can make the ratio small.
    assert cell["ratio"] == pytest.approx(cell["4"] / cell["2"], rel=1e-2, abs=2e-3)
  assert len(lines) == 4 and "E=4/E=2" in lines[0]
