"""The embedded default target (SmolLM2-135M-Instruct GGUF) vs transformers' GGUF loader.

The fixture tests/fixtures/smollm2_gguf_greedy.json was produced by transformers
(tests/fixtures/make_hf_fixtures.py); no torch is needed here.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models import causal_mask
from tests.helpers import FIXTURES

FIXTURE = FIXTURES / "smollm2_gguf_greedy.json"


@pytest.fixture(scope="module")
def expected():
  return json.loads(FIXTURE.read_text())


def test_default_is_smollm2(smollm2):
  c = smollm2.config
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
      30, 576, 9, 3, 49152)
  assert c.tie_embeddings and c.rope_theta == 1e5


def _cases(expected):
  return expected["prompts"]


def test_chat_prompt_ids_match(smollm2, expected):
  for case in _cases(expected):
    ids = smollm2.tokenizer.encode_chat(case["messages"], add_generation_prompt=True)
    assert ids == case["prompt_ids"], case["messages"]


def test_top5_logits_match(smollm2_float32, expected):
  smollm2 = smollm2_float32
  case = _cases(expected)[0]
  ids = case["prompt_ids"]
  n = len(ids)
  out = smollm2.forward(jnp.asarray(ids)[None], jnp.arange(n)[None],
                        smollm2.new_cache(1, n), causal_mask(1, n),
                        logit_rows=jnp.asarray([[n - 1]]))
  logits = np.asarray(out.logits[0, 0])
  top = expected["first_prompt_last_position_top5"]
  top_ids = top["ids"]
  assert np.argsort(-logits)[:5].tolist() == top_ids
  np.testing.assert_allclose(logits[top_ids], top["logits"], atol=2e-3)


def test_greedy_chat_answers_match_transformers(smollm2_float32, expected):
  smollm2 = smollm2_float32
  cases = _cases(expected)
  prompts = [c["prompt_ids"] for c in cases]
  out = dj.generate(smollm2, prompts, max_new_tokens=max(len(c["greedy_ids"]) for c in cases))
  for case, got in zip(cases, out.tokens):
    want = case["greedy_ids"]
    assert got[:len(want)] == want, case["messages"]
    if case.get("stopped_at_eos"):
      assert got == want  # stopped at the same EOS


def test_gguf_file_loads_identically(smollm2):
  direct = dj.load_target(dj.io.embedded_gguf_path())
  a = jax.tree.leaves(smollm2.params)
  b = jax.tree.leaves(direct.params)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
