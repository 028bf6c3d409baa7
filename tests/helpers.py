"""What several test modules share: paths, the tiny targets, prompt and head
makers, and the statistics of the sampling tests."""

import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

import dart_jax as dj
from dart_jax.draft.dart_head import DartHeadModule
from dart_jax.models import ModelConfig, Target
from dart_jax.models.transformer import Transformer
from dart_jax.sampling import SamplingConfig, processed_log_probs

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
TINY_TARGET = str(ROOT / "train" / "sample_data" / "tiny_target")

TARGETS = {
    "llama": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=256),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, intermediate_size=48,
                         num_layers=5, num_heads=4, num_kv_heads=1, head_dim=16,
                         qk_norm=True, tie_embeddings=True, max_position_embeddings=256),
    # 8 experts, top-2, sparse layers 0 and 2 around a dense one.
    "qwen3_moe": ModelConfig(arch="qwen3_moe", vocab_size=97, hidden_size=32,
                             intermediate_size=48, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=8, qk_norm=True,
                             max_position_embeddings=256, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=16,
                             sparse_layers=(0, 2)),
}
# Every lossless test runs in both modes: the CPU default (bf16 weights, exact
# split dots) and exact float32.
PRECISIONS = ("fast", "float32")

# Short chat prompts for the embedded SmolLM2 (not benchmark prompts).
SMOLLM2_PROMPTS = [
    "What is 2 + 2?", "Name a color.", "Say hello in French.", "What is the sun?",
    "Write one word about cats.", "Count to five.", "What is water made of?",
    "Give me a fruit.", "Who wrote Hamlet?", "What is a prime number?",
    "Translate 'thank you' to Spanish.", "What day comes after Monday?",
    "Describe rain in three words.", "What is the capital of Italy?",
    "Name an ocean.", "What do bees make?", "Spell 'cat' backwards.",
    "What is ice?", "Name a planet.", "How many legs does a spider have?",
]


def random_prompts(rng, n: int, vocab: int) -> list[list[int]]:
  """n prompts of 1..11 random token ids."""
  return [rng.integers(0, vocab, rng.integers(1, 12)).tolist() for _ in range(n)]


def shape_only_target(config: ModelConfig) -> Target:
  """A target with abstract parameters: enough for config checks, no init cost."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  return Target(config, graphdef, params)


def numpy_head(target, draft_length: int, draft_vocab: int, seed: int) -> dj.DartHead:
  """A random head drawn with numpy (no per-op XLA compiles: fast tests)."""
  tc = target.config
  config = dj.DartConfig(
      hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
      num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
      vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab,
      target_hidden_size=tc.hidden_size, draft_length=draft_length,
      tap_layers=tc.dart_tap_layers, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
      rope_scaling=tc.rope_scaling)
  abstract = nnx.eval_shape(lambda: DartHeadModule(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)
  leaves = []
  for path, var in nnx.to_flat_state(state):
    name = "/".join(str(p) for p in path)
    if name in ("d2t", "t2d"):
      value = np.zeros(var.shape, var.dtype) if name == "d2t" else np.ones(var.shape, bool)
    elif name.endswith("scale"):
      value = 1 + 0.1 * rng.standard_normal(var.shape)
    else:
      value = (0.3 if name.endswith("mask_rep") else 0.1) * rng.standard_normal(var.shape)
    leaves.append((path, var.replace(jnp.asarray(value, var.dtype))))
  head = dj.DartHead(config, graphdef, nnx.from_flat_state(leaves))
  return head.with_draft_vocab(np.sort(rng.choice(tc.vocab_size, draft_vocab, replace=False)))


def chi_square_p(counts, probs):
  """Chi-square goodness-of-fit p-value; outcomes expected < 5 times are lumped."""
  total = counts.sum()
  impossible = probs == 0
  assert counts[impossible].sum() == 0, "sampled an outcome the target excludes"
  keep = probs * total >= 5
  rare = ~keep & ~impossible
  observed, expected = counts[keep], probs[keep] * total
  if rare.any():
    observed = np.append(observed, counts[rare].sum())
    expected = np.append(expected, probs[rare].sum() * total)
  return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue



def exact_first_tokens(target, prompt, sampling, n=3):
  """The target's exact distribution of its first n sampled tokens [V**n]
  (one jitted cache-free pass over every continuation)."""
  vocab = target.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=n)), np.int32)
  full = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], 1)

  @jax.jit
  def log_probs(params, tokens):
    length = tokens.shape[1]
    col = jnp.arange(length)
    mask = jnp.broadcast_to(col[None, :] <= col[:, None], (tokens.shape[0], length, length))
    out = nnx.merge(target.graphdef, params)(tokens, jnp.broadcast_to(col, tokens.shape),
                                             None, mask)
    return processed_log_probs(out.logits, sampling)

  logp = np.asarray(log_probs(target.params, jnp.asarray(full)), np.float64)
  p0 = len(prompt) - 1
  total = sum(logp[np.arange(len(seqs)), p0 + j, seqs[:, j]] for j in range(n))
  return np.exp(total)


SAMPLING_VOCAB, SAMPLING_TEMPERATURE, SAMPLING_TOP_P = 6, 0.8, 0.9


def peaked_tiny_target(mode: str) -> Target:
  """A 6-token target with peaked distributions (weights x3), so that even a
  random drafter's trees are often accepted; ``mode`` its precision."""
  config = ModelConfig(arch="llama", vocab_size=SAMPLING_VOCAB, hidden_size=16,
                       intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=8)
  target = Target.init(config, seed=7, dtype=mode)
  return target.with_params(jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x,
                                         target.params))


def check_first_tokens_distribution(target, name: str, min_accept: float = 1.3,
                                    **generate_kwargs) -> None:
  """Asserts that the first 3 sampled tokens of ``generate(..., **generate_kwargs)``
  follow the target's exact distribution: 20000 samples, chi-square and marginal
  total variation (test_speculative shows these statistics detect a 2% bias)."""
  vocab, prompt = SAMPLING_VOCAB, [1, 4, 2]
  exact = exact_first_tokens(target, prompt,
                             SamplingConfig(SAMPLING_TEMPERATURE, SAMPLING_TOP_P))
  n_batch, n_calls = 5000, 4
  counts = np.zeros(vocab ** 3)
  accept = []
  for seed in range(n_calls):
    out = dj.generate(target, [prompt] * n_batch, max_new_tokens=3,
                      temperature=SAMPLING_TEMPERATURE, top_p=SAMPLING_TOP_P, seed=seed,
                      eos_token_ids=(), **generate_kwargs)
    codes = np.array([(t[0] * vocab + t[1]) * vocab + t[2] for t in out.tokens])
    counts += np.bincount(codes, minlength=vocab ** 3)
    accept.append(out.stats.mean_accept_len)
  assert np.mean(accept) > min_accept  # drafts were accepted, so acceptance mattered
  p_value = chi_square_p(counts, exact)
  joint, want = counts.reshape((vocab,) * 3) / counts.sum(), exact.reshape((vocab,) * 3)
  tvs = [0.5 * np.abs(joint.sum(axis=tuple(a for a in range(3) if a != k)) -
                      want.sum(axis=tuple(a for a in range(3) if a != k))).sum()
         for k in range(3)]
  print(f"{name}: chi-square p={p_value:.3f}, marginal TVs {np.round(tvs, 4)}, "
        f"acceptance {np.mean(accept):.2f}")
  assert p_value > 1e-3, p_value
  assert max(tvs) < 0.02, tvs
