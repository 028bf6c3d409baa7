"""Trains the tiny target model of the ``tiny`` training preset (seeded; ~10 min on 2 CPU cores).

    python train/sample_data/make_tiny_target.py

A 4-layer, hidden-64 Llama (vocab 320, tied embeddings, float16 weights, about
0.3 MB) trained as a plain language model on the bundled sample chats rendered
with the tiny ChatML tokenizer of ``tests/fixtures/tiny_llama``. A DART head can
only learn to predict a target whose outputs depend on the text in a learnable
way; a randomly initialised target's next-token distribution is dominated by the
current token, so the mask levels of a head would have nothing to learn. Written
to ``train/sample_data/tiny_target/`` as a HF directory (config.json,
model.safetensors, tokenizer files) that ``dart_jax.load_target`` reads.
"""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from dart_jax.io import Tokenizer, write_safetensors_dir  # noqa: E402
from dart_jax.models import Target  # noqa: E402
from dart_jax.models.config import config_from_hf  # noqa: E402
from dart_jax.models.target import hf_name  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import losses  # noqa: E402
from train.configs import SAMPLE_DATA  # noqa: E402

TOKENIZER_DIR = os.path.join(ROOT, "tests", "fixtures", "tiny_llama")
OUT_DIR = os.path.join(HERE, "tiny_target")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
STEPS = 1500
BATCH = 16
MAX_LEN = 128
SEED = 0

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 512, "bos_token_id": None, "eos_token_id": 2,
    "hidden_act": "silu", "torch_dtype": "float16",
}


def main() -> None:
  tokenizer = Tokenizer.from_dir(TOKENIZER_DIR)
  stats = data_lib.DataStats()
  records = data_lib.read_records(SAMPLE_DATA, stats)
  examples = data_lib.tokenize_records(tokenizer, records, stats)
  # Every token is a language-model target here (not only the assistant's).
  examples = [data_lib.Example(e.tokens, np.ones_like(e.loss_mask)) for e in examples]
  rows = data_lib.pack_examples(examples, MAX_LEN, pack=True)
  config = config_from_hf(HF_CONFIG)
  target = Target.init(config, seed=SEED, dtype=jnp.float32)
  graphdef, params = target.graphdef, target.params
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 100, STEPS, 1e-4)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      model = nnx.merge(graphdef, p)
      mask = losses.target_attention_mask(batch["segment_ids"])
      out = model(batch["tokens"], batch["positions"], None, mask, attn_impl="xla")
      logp = jax.nn.log_softmax(out.logits[:, :-1])
      nll = -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
      w = batch["loss_mask"][:, 1:] & (batch["positions"][:, 1:] > 0)
      return jnp.sum(nll * w) / jnp.sum(w)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  it = data_lib.BatchIterator(rows, BATCH, SEED)
  for i in range(STEPS):
    params, opt_state, loss = step(params, opt_state, next(it))
    if i % 100 == 0 or i == STEPS - 1:
      print(f"step {i}: loss {float(loss):.3f}", flush=True)

  tensors = {}
  for path, var in nnx.to_flat_state(params):
    key = "/".join(str(p) for p in path)
    array = np.asarray(var[...], np.float32)
    if key.endswith("/kernel"):
      array = array.T
    tensors[hf_name(key)] = array.astype(np.float16)
  if os.path.isdir(OUT_DIR):
    shutil.rmtree(OUT_DIR)
  write_safetensors_dir(OUT_DIR, HF_CONFIG, tensors)
  for name in TOKENIZER_FILES:
    shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(OUT_DIR, name))
  with open(os.path.join(OUT_DIR, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": 2}, f)
  print(f"wrote {OUT_DIR}")


if __name__ == "__main__":
  main()
