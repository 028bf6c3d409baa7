"""Parity with HF transformers, from fixtures it produced (tests/fixtures/README.md).

No torch here: the fixtures hold transformers' logits and greedy ids.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models import causal_mask
from dart_jax.models.config import rope_inv_freq
from tests.helpers import FIXTURES

MODELS = ("tiny_llama", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral")


@pytest.fixture(scope="module")
def reference():
  """Every fixture array: dense models in hf_parity.npz, MoE ones in hf_parity_moe.npz."""
  arrays = {}
  for name in ("hf_parity.npz", "hf_parity_moe.npz"):
    with np.load(FIXTURES / name) as f:
      arrays.update({k: f[k] for k in f.files})
  return arrays


@pytest.fixture(scope="module", params=MODELS)
def model(request):
  # Parity with transformers is checked in the exact float32 mode.
  return request.param, dj.load_target(FIXTURES / request.param, dtype="float32")


def test_rope_frequencies_match(model, reference):
  name, target = model
  c = target.config
  np.testing.assert_allclose(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                             reference[f"{name}/rope_inv_freq"], rtol=1e-6)


@pytest.mark.parametrize("i", range(3))
def test_prefill_logits_match(model, reference, i):
  name, target = model
  ids = reference[f"{name}/prompt_ids_{i}"]
  want = reference[f"{name}/prefill_logits_{i}"]
  n = len(ids)
  out = target.forward(jnp.asarray(ids)[None], jnp.arange(n)[None],
                       target.new_cache(1, n), causal_mask(1, n))
  np.testing.assert_allclose(np.asarray(out.logits[0]), want, atol=1e-4, rtol=0)


def test_greedy_continuations_match(model, reference):
  name, target = model
  prompts = [reference[f"{name}/prompt_ids_{i}"].tolist() for i in range(3)]
  want = [reference[f"{name}/greedy_ids_{i}"].tolist() for i in range(3)]
  out = dj.generate(target, prompts, max_new_tokens=len(want[0]), eos_token_ids=())
  assert out.tokens == want
  single = dj.generate(target, prompts[2], max_new_tokens=len(want[2]), eos_token_ids=())
  assert single.tokens == want[2]


def test_chat_template_and_greedy_chat_match(model, reference):
  name, target = model
  messages = [{"role": "user", "content": "Hello there, how are you?"}]
  ids = target.tokenizer.encode_chat(messages, add_generation_prompt=True)
  assert ids == reference[f"{name}/chat_prompt_ids"].tolist()
  want = reference[f"{name}/chat_greedy_ids"].tolist()
  out = dj.generate(target, "Hello there, how are you?", max_new_tokens=len(want),
                    eos_token_ids=())
  assert out.tokens == want


def test_config_forms(model):
  name, target = model
  raw = json.loads((FIXTURES / name / "config.json").read_text())
  if name == "tiny_llama":
    assert "rope_scaling" in raw and target.config.rope_scaling is not None
    assert not target.config.tie_embeddings
  elif name == "tiny_qwen3_moe":
    c = target.config
    assert "rope_parameters" in raw and "num_experts" in raw and c.qk_norm
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (8, 2, True)
    assert c.sparse_layers == (0, 2)  # layer 1 is in mlp_only_layers
  elif name == "tiny_mixtral":
    c = target.config
    assert "rope_theta" in raw and "num_local_experts" in raw and not c.qk_norm
    assert (c.num_experts, c.num_experts_per_tok, c.sparse_layers) == (4, 2, (0, 1))
  else:
    assert "rope_parameters" in raw and target.config.rope_theta == 1e6
    assert target.config.tie_embeddings and target.config.qk_norm
    assert target.config.head_dim == 32
