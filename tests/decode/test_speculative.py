"""DART speculative decoding is lossless, and its acceptance accounting is right."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models import ModelConfig, Target
from dart_jax.ngram import NGram
from dart_jax.sampling import SamplingConfig
from dart_jax.decode.dart import dart_decoder
from dart_jax.tree import TreeConfig
from tests.helpers import (PRECISIONS, SMOLLM2_PROMPTS, TARGETS, chi_square_p, exact_first_tokens,
                           random_prompts)

TREE = TreeConfig(topk=6, beam_width=4, remain_total=14)


@pytest.fixture(scope="module",
                params=[(arch, mode) for arch in sorted(TARGETS) for mode in PRECISIONS],
                ids=lambda p: "-".join(p))
def tiny(request):
  arch, mode = request.param
  target = Target.init(TARGETS[arch], seed=2, dtype=mode)
  head = dj.DartHead.init(target, draft_length=3, draft_vocab_size=60, seed=4)
  return target, head


def test_greedy_equals_ar_batched_and_single(tiny):
  target, head = tiny
  rng = np.random.default_rng(0)
  prompts = random_prompts(rng, 20, 97)
  corpus = [rng.integers(0, 97, 200).tolist() for _ in range(5)]
  ar = [dj.generate(target, prompts[i:i + 4], max_new_tokens=24, eos_token_ids=()).tokens
        for i in range(0, 20, 4)]
  # Feed the target's own outputs to the N-gram so its term shapes the trees.
  ngram = NGram.build(corpus + [p + t for p, t in zip(prompts, sum(ar, []))], order=3)
  extra_accepted = 0.0
  for i in range(0, 20, 4):
    sp = dj.generate(target, prompts[i:i + 4], max_new_tokens=24, draft=head,
                     ngram=ngram, tree=TREE, eos_token_ids=())
    assert sp.tokens == ar[i // 4]
    extra_accepted += sp.stats.mean_accept_len - 1.0
  assert extra_accepted > 0  # some drafts were right, so acceptance paths ran
  # The reference search (no context N-gram) is lossless too.
  plain = dj.generate(target, prompts[:4], max_new_tokens=24, draft=head, ngram=ngram,
                      tree=TREE, eos_token_ids=(), context_ngram=False)
  assert plain.tokens == ar[0]
  if target.config.arch == "llama":  # batch 1 compiles anew: check it once per mode
    single = dj.generate(target, prompts[7], max_new_tokens=24, draft=head, ngram=ngram,
                         tree=TREE, eos_token_ids=())
    assert single.tokens == ar[1][3]


def test_eos_and_max_new_tokens_stop_at_the_same_place(tiny):
  target, head = tiny
  rng = np.random.default_rng(1)
  prompts = random_prompts(rng, 4, 97)
  free = dj.generate(target, prompts, max_new_tokens=20, eos_token_ids=()).tokens
  eos = free[0][5]  # a token the first sequence emits mid-way
  ar = dj.generate(target, prompts, max_new_tokens=20, eos_token_ids=(eos,))
  sp = dj.generate(target, prompts, max_new_tokens=20, eos_token_ids=(eos,), draft=head,
                   tree=TREE)
  assert sp.tokens == ar.tokens
  assert ar.tokens[0][-1] == eos and len(ar.tokens[0]) <= 6
  for n in (1, 2, 7):
    assert dj.generate(target, prompts, max_new_tokens=n, draft=head, tree=TREE,
                       eos_token_ids=()).tokens == [f[:n] for f in free]


def test_generate_ranks_the_target_eos_last_unless_told_otherwise(smollm2):
  """``generate``'s DART decoder applies the reference's EOS rule with the target's
  EOS (the tokenizer's), unless the tree config names an id or None."""
  from dart_jax.decode.methods import make_decoder

  head = dj.load_dart(target=smollm2)
  eos = smollm2.tokenizer.eos_token_ids[0]
  assert eos == smollm2.tokenizer.token_to_id("<|im_end|>")

  def decoder_eos(**kwargs):
    return make_decoder(smollm2, SamplingConfig(), 0, head, **kwargs).proposer.tree_config.eos_id

  assert head.tree.eos_id == "target" and head.panel_tree.eos_id == "target"
  assert decoder_eos() == eos
  assert decoder_eos(tree=TreeConfig(remain_total=8)) == eos
  assert decoder_eos(tree=TreeConfig(eos_id=None)) is None
  assert decoder_eos(tree=TreeConfig(eos_id=7)) == 7
  with pytest.raises(dj.ConfigError, match="eos_id"):
    TreeConfig(eos_id="eos")


def _oracle_logits(continuations, root_pos, draft_length, d2t, vocab):
  """Draft logits whose argmax at level l is the target's token at root_pos+1+l."""
  batch = len(continuations)
  logits = np.full((batch, draft_length + 1, len(d2t)), -10.0, np.float32)
  t2d = {int(i + d): i for i, d in enumerate(d2t)}
  for b, seq in enumerate(continuations):
    for l in range(draft_length + 1):
      pos = int(root_pos[b]) + 1 + l
      if pos < len(seq) and int(seq[pos]) in t2d:
        logits[b, l, t2d[int(seq[pos])]] = 10.0
  return jnp.asarray(logits)


def test_oracle_head_reaches_maximum_acceptance(tiny):
  """With drafts forced to the target's future, every round accepts D+1 + bonus."""
  target, _ = tiny
  head = dj.DartHead.init(target, draft_length=3, seed=4)  # full draft vocabulary
  d = head.config.draft_length
  prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
  ar = dj.generate(target, prompts, max_new_tokens=40, eos_token_ids=()).tokens
  full = [p + a for p, a in zip(prompts, ar)]
  batch, width = 2, 32
  tokens = np.zeros((batch, width), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  lens = jnp.asarray([len(p) for p in prompts])
  capacity = 128
  decoder = dart_decoder(target, head, sampling=SamplingConfig(), tree=TREE,
                         context_ngram=False)
  state, _ = decoder.start(jnp.asarray(tokens), lens, capacity)
  d2t = np.asarray(head.params["d2t"][...])
  for _ in range(5):
    root_pos = np.asarray(state.cache.lengths)
    oracle = _oracle_logits(full, root_pos, d, d2t, 97)
    state = state.replace(draft=state.draft.replace(logits=oracle))
    state, new_tokens, num_new = decoder.step(state, jnp.ones(batch, bool), capacity)
    np.testing.assert_array_equal(num_new, [d + 2] * batch)
    for b in range(batch):
      start = int(root_pos[b]) + 1
      assert np.asarray(new_tokens[b]).tolist() == full[b][start:start + d + 2]


SAMPLING_TARGET = ModelConfig(arch="llama", vocab_size=6, hidden_size=16,
                              intermediate_size=32, num_layers=2, num_heads=2,
                              num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("mode", PRECISIONS)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_matches_target_distribution(temperature, top_p, mode):
  """First 3 sampled tokens: DART and AR both match the target's exact distribution.

  20000 samples per method; the same statistics reject a 2% bias (checked below on
  a deliberately biased distribution), so a biased acceptance rule would fail.
  """
  check_sampling(SAMPLING_TARGET, temperature, top_p, mode)


def test_sampling_matches_an_moe_target_distribution():
  """The same check on a mixture-of-experts target (4 experts, top-2, one dense layer)."""
  config = dataclasses.replace(SAMPLING_TARGET, arch="qwen3_moe", num_layers=3,
                               qk_norm=True, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, sparse_layers=(0, 2))
  check_sampling(config, 1.0, 1.0, "fast")


def check_sampling(config: ModelConfig, temperature: float, top_p: float, mode: str):
  vocab = config.vocab_size
  target = Target.init(config, seed=7, dtype=mode)
  # Sharpen the random target so that the drafts matter and top-p cuts something.
  target = target.with_params(jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x,
                                           target.params))
  head = dj.DartHead.init(target, draft_length=2, seed=1)
  prompt = [1, 4, 2]
  exact = exact_first_tokens(target, prompt, SamplingConfig(temperature, top_p))
  tree = TreeConfig(topk=3, beam_width=3, remain_total=8)
  n_batch, n_calls = 5000, 4
  counts = {"dart": np.zeros(vocab ** 3), "ar": np.zeros(vocab ** 3)}
  for seed in range(n_calls):
    for name, kw in (("dart", dict(draft=head, tree=tree)), ("ar", {})):
      out = dj.generate(target, [prompt] * n_batch, max_new_tokens=3,
                        temperature=temperature, top_p=top_p, seed=seed,
                        eos_token_ids=(), **kw)
      codes = np.array([(t[0] * vocab + t[1]) * vocab + t[2] for t in out.tokens])
      counts[name] += np.bincount(codes, minlength=vocab ** 3)
  total = n_batch * n_calls
  exact_marginals = exact.reshape(vocab, vocab, vocab)
  for name, c in counts.items():
    p_value = chi_square_p(c, exact)
    joint = c.reshape(vocab, vocab, vocab) / total
    tvs = [0.5 * np.abs(joint.sum(axis=tuple(a for a in range(3) if a != k)) -
                        exact_marginals.sum(axis=tuple(a for a in range(3) if a != k))).sum()
           for k in range(3)]
    print(f"{name}: chi-square p={p_value:.3f}, marginal total variations {np.round(tvs, 4)}")
    assert p_value > 1e-3, (name, p_value)
    assert max(tvs) < 0.02, (name, tvs)
  # Power: 2% of the mass moved onto the likeliest outcome is detected.
  biased = 0.98 * exact / exact.sum()  # float32 probabilities may sum to 1 + eps
  biased[np.argmax(exact)] += 0.02
  rng = np.random.default_rng(0)
  rejected = [chi_square_p(rng.multinomial(total, biased).astype(float), exact) < 1e-3
              for _ in range(20)]
  assert np.mean(rejected) >= 0.9


def test_bad_arguments(tiny):
  target, head = tiny
  with pytest.raises(dj.InputError, match="temperature"):
    dj.generate(target, [1, 2], temperature=-1.0, draft=head)
  with pytest.raises(dj.InputError, match="top_p"):
    dj.generate(target, [1, 2], temperature=1.0, top_p=0.0, draft=head)
  with pytest.raises(dj.InputError, match="top_p"):
    dj.generate(target, [1, 2], temperature=1.0, top_p=1.5)
  with pytest.raises(dj.InputError, match="fit"):
    dj.generate(target, [1] * 250, draft=head, tree=TREE, max_new_tokens=4)
  other = Target.init(ModelConfig(arch="llama", vocab_size=50, hidden_size=32,
                                  intermediate_size=64, num_layers=4, num_heads=4,
                                  num_kv_heads=2, head_dim=8), seed=0)
  with pytest.raises(dj.ConfigError, match="vocab"):
    dj.generate(other, [1, 2], draft=head)
  with pytest.raises(dj.InputError, match="draft"):
    dj.generate(target, [1, 2], ngram=NGram.build([[1, 2, 3]]))


@pytest.mark.parametrize("target_fixture,num_prompts", [("smollm2", 20),
                                                        ("smollm2_float32", 8)])
def test_smollm2_shipped_head_greedy_equals_ar(request, target_fixture, num_prompts):
  """The embedded SmolLM2 with the shipped head, N-gram and default tree: chat
  prompts in batches of 4 give AR's tokens, and the trained head is accepted
  (20 prompts in the default fast mode, 8 in float32)."""
  smollm2 = request.getfixturevalue(target_fixture)
  head, ngram = dj.load_dart(target=smollm2), dj.load_ngram()
  accept_lens = []
  for i in range(0, num_prompts, 4):
    batch = SMOLLM2_PROMPTS[i:i + 4]
    ar = dj.generate(smollm2, batch, max_new_tokens=16)
    sp = dj.generate(smollm2, batch, max_new_tokens=16, draft=head, ngram=ngram)
    assert sp.tokens == ar.tokens, batch
    accept_lens.append(sp.stats.mean_accept_len)
  # A random head stays at ~1.0 token per round (measured); a trained one beats it.
  assert np.mean(accept_lens) > 1.25, accept_lens


def test_the_shipped_heads_default_tree_follows_the_targets_dense_layout(smollm2):
  """Without a tree, DART searches the one measured for the target's dense
  layout: the panel form's (a smaller tree: a 7th row costs a second register
  tile there) or the head's own; a given tree always wins."""
  from dart_jax.decode.methods import make_decoder

  head = dj.load_dart(target=smollm2)
  assert head.panel_tree.remain_total < head.tree.remain_total
  panels, rows = (types.SimpleNamespace(dense_layout=layout) for layout in ("panels", "weight"))
  assert head.default_tree(panels) is head.panel_tree and head.default_tree(rows) is head.tree
  assert dataclasses.replace(head, panel_tree=None).default_tree(panels) is head.tree

  def nodes(**kwargs):
    return make_decoder(smollm2, SamplingConfig(), 0, head, **kwargs).proposer.num_nodes

  expected = head.panel_tree if smollm2.dense_layout == "panels" else head.tree
  assert nodes() == expected.remain_total
  assert nodes(tree=TreeConfig(remain_total=8)) == 8
