"""DARTree decoding and its baselines are lossless; the round keeps the drafter's
context right.

Compile time dominates (it grows with the number of layers): the tiny targets
have 2 layers, the drafters 1; every test uses batch 4, capacity 256 and
attend_len 64 (what ``generate`` picks for these prompts), so each (method,
target) round compiles once. The DFlash chain runs on the Domino drafter's
backbone ("dflash-chain"); a plain DFlash drafter ("chain") on Llama only.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.decode.methods import make_decoder
from dart_jax.decode.round import root_tokens
from dart_jax.models import ModelConfig, Target
from dart_jax.ngram import NGram
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import DARTreeConfig
from tests.helpers import (PRECISIONS, SMOLLM2_PROMPTS, TARGETS, check_first_tokens_distribution,
                           peaked_tiny_target, random_prompts, shape_only_target)

TARGETS_2L = {arch: dataclasses.replace(config, num_layers=2, sparse_layers=tuple(
                  i for i in config.sparse_layers if i < 2))
              for arch, config in TARGETS.items()}
TREE = DARTreeConfig(topk=4, supertree_width=3, budget=8)
# "chain" on the Domino drafter is the Domino chain.
DOMINO_METHODS = ("dartree", "dartree-fixed", "ddtree", "chain", "dflash-chain")
BLOCK = 4  # D = 3 draft depths


@pytest.fixture(scope="module",
                params=[(arch, mode) for arch in sorted(TARGETS_2L) for mode in PRECISIONS],
                ids=lambda p: "-".join(p))
def tiny(request):
  arch, mode = request.param
  target = Target.init(TARGETS_2L[arch], seed=2, dtype=mode)
  domino = dj.DFlashDrafter.init(target, block_size=BLOCK, num_layers=1, domino=True,
                                 seed=4)
  dflash = dj.DFlashDrafter.init(target, block_size=BLOCK, num_layers=1, seed=5)
  return target, domino, dflash


def _runs(target, domino, dflash):
  runs = [(domino, m) for m in DOMINO_METHODS]
  return runs + [(dflash, "chain")] if target.config.arch == "llama" else runs


def test_greedy_equals_ar_for_every_method(tiny):
  """Batch of 4 ragged prompts, token for token vs AR, every method."""
  target, domino, dflash = tiny
  prompts = random_prompts(np.random.default_rng(0), 4, 97)
  ar = dj.generate(target, prompts, max_new_tokens=20, eos_token_ids=()).tokens
  for drafter, method in _runs(target, domino, dflash):
    out = dj.generate(target, prompts, max_new_tokens=20, draft=drafter, tree=method,
                      tree_config=TREE, eos_token_ids=())
    assert out.tokens == ar, (method, drafter.domino)
  # (Random drafters rarely guess right; the oracle test below runs full
  # acceptance through every method.)


def _start(decoder, prompts, capacity=256):
  tokens = np.zeros((len(prompts), 32), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
  return decoder.start(jnp.asarray(tokens), lens, capacity)


def _oracle(state, full, depths):
  """Base logits whose top token at depth d is the target's token at root + d."""
  root_pos = np.asarray(state.cache.lengths)
  oracle = np.full(state.draft.base_logits.shape, -10.0, np.float32)
  for b in range(oracle.shape[0]):
    for d in range(1, depths + 1):
      oracle[b, d - 1, full[b][root_pos[b] + d]] = 10.0
  return state.replace(draft=state.draft.replace(base_logits=jnp.asarray(oracle)))


def test_drafter_context_after_rounds_equals_a_fresh_prefill(tiny):
  """After rounds with long accepted paths (oracle drafts) and short ones (the
  random drafter's own), the drafter's state (context from the accepted nodes'
  taps, block K/V dropped) gives the same base logits as prefilling the whole
  committed sequence from scratch."""
  target, domino, _ = tiny
  prompts = random_prompts(np.random.default_rng(1), 4, 97)
  ar = dj.generate(target, prompts, max_new_tokens=20, eos_token_ids=()).tokens
  full = [p + a for p, a in zip(prompts, ar)]
  decoder = make_decoder(target, SamplingConfig(), 0, domino, tree="dartree",
                         tree_config=TREE)
  state, first = _start(decoder, prompts)
  emitted = [[int(f)] for f in np.asarray(first)]
  for use_oracle in (True, False, True, False):
    if use_oracle:
      state = _oracle(state, full, BLOCK - 1)
    state, new, num = decoder.step(state, jnp.ones(4, bool), 64)
    if use_oracle:
      np.testing.assert_array_equal(np.asarray(num), [BLOCK] * 4)
    for b in range(4):
      emitted[b] += np.asarray(new[b, :int(num[b])]).tolist()
  committed = [p + e[:-1] for p, e in zip(prompts, emitted)]  # the root is not cached
  assert all(c == f[:len(c)] for c, f in zip(committed, full))
  np.testing.assert_array_equal(np.asarray(state.cache.lengths),
                                [len(c) for c in committed])
  np.testing.assert_array_equal(np.asarray(state.draft.cache.lengths),
                                [len(c) for c in committed])
  fresh, root = _start(decoder, committed)
  np.testing.assert_array_equal(np.asarray(root), [e[-1] for e in emitted])
  np.testing.assert_array_equal(np.asarray(root_tokens(state)), np.asarray(root))
  np.testing.assert_allclose(np.asarray(state.draft.base_logits),
                             np.asarray(fresh.draft.base_logits), atol=2e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(state.draft.hidden), np.asarray(fresh.draft.hidden),
                             atol=2e-5, rtol=1e-4)


def test_oracle_drafts_reach_maximum_acceptance(tiny):
  """With base logits forced to the target's future, every method accepts all
  D depths plus the bonus token every round (and emits the right tokens)."""
  target, domino, dflash = tiny
  prompts = random_prompts(np.random.default_rng(2), 4, 97)
  ar = dj.generate(target, prompts, max_new_tokens=40, eos_token_ids=()).tokens
  full = [p + a for p, a in zip(prompts, ar)]
  depths = BLOCK - 1
  for drafter, method in _runs(target, domino, dflash):
    decoder = make_decoder(target, SamplingConfig(), 0, drafter, tree=method,
                           tree_config=TREE)
    state, _ = _start(decoder, prompts)
    for _ in range(4):
      root_pos = np.asarray(state.cache.lengths)
      state = _oracle(state, full, depths)
      state, new, num = decoder.step(state, jnp.ones(4, bool), 64)
      np.testing.assert_array_equal(np.asarray(num), [BLOCK] * 4, err_msg=method)
      for b in range(4):
        start = root_pos[b] + 1
        assert np.asarray(new[b]).tolist() == full[b][start:start + BLOCK], method


@pytest.mark.parametrize("mode", PRECISIONS)
@pytest.mark.parametrize("method", ["dartree", "dartree-fixed", "ddtree", "domino-chain",
                                    "dflash-chain"])
def test_sampling_matches_target_distribution(method, mode):
  """Every DARTree-family method samples the target's distribution (they share
  the accept step but build different trees, and the chains use other drafts)."""
  target = peaked_tiny_target(mode)
  # Block 4 (3 depths) and budget 5 < the 9-node fixed tree; a correction scaled
  # up so that it changes the corrected methods' trees (a random one barely does).
  drafter = dj.DFlashDrafter.init(target, block_size=4, domino=method != "dflash-chain",
                                  emb_dim=8, gru_hidden_dim=8, seed=1)
  if drafter.domino:
    params = drafter.params
    for name in ("embed_proj_in", "embed_proj_out"):
      params[name]["kernel"][...] = params[name]["kernel"][...] * 8.0
    drafter = drafter.with_params(params)
  check_first_tokens_distribution(
      target, method, min_accept=1.2 if method.endswith("chain") else 1.3,
      draft=drafter, tree=method,
      tree_config=DARTreeConfig(topk=3, supertree_width=3, budget=5))


def test_bad_arguments_give_clear_errors(tiny):
  target, domino, dflash = tiny
  with pytest.raises(dj.ConfigError, match="unknown DARTree method"):
    dj.generate(target, [1, 2], draft=domino, tree="beam")
  with pytest.raises(dj.ConfigError, match="needs the Domino correction head"):
    dj.generate(target, [1, 2], draft=dflash, tree="dartree")
  with pytest.raises(dj.ConfigError, match="depth_bonus must be <= 0"):
    dj.generate(target, [1, 2], draft=domino, depth_bonus=0.5)
  with pytest.raises(dj.InputError, match="unknown DARTree option"):
    dj.generate(target, [1, 2], draft=domino, beam_width=3)
  with pytest.raises(dj.InputError, match="N-gram"):
    dj.generate(target, [1, 2], draft=domino, ngram=NGram.build([[1, 2, 3]]))
  with pytest.raises(dj.InputError, match="does not fit"):
    dj.generate(target, [1] * 250, draft=domino, tree_config=TREE, max_new_tokens=4)
  other = shape_only_target(ModelConfig(arch="llama", vocab_size=50, hidden_size=32,
                                        intermediate_size=64, num_layers=4, num_heads=4,
                                        num_kv_heads=2, head_dim=8))
  with pytest.raises(dj.ConfigError, match="vocab 97 vs target 50"):
    dj.generate(other, [1, 2], draft=domino)
  # Option plumbing (no compile): a config as tree=, keyword overrides.
  greedy = SamplingConfig()
  decoder = make_decoder(target, greedy, 0, domino, tree=TREE)
  proposer = decoder.proposer
  assert (proposer.method, proposer.tree_config, decoder.scratch_rows) == ("dartree", TREE, 9)
  decoder = make_decoder(target, greedy, 0, domino, tree="dartree-fixed", budget=5,
                         topk=2)
  assert decoder.proposer.tree_config == DARTreeConfig(topk=2, budget=5)
  assert decoder.proposer.num_nodes == 5
  assert make_decoder(target, greedy, 0, dflash, tree="chain").proposer.method == "dflash-chain"
  assert make_decoder(target, greedy, 0, domino, tree="chain").proposer.num_nodes == BLOCK - 1


@pytest.mark.parametrize("target_fixture", ["smollm2", "smollm2_float32"])
def test_smollm2_random_domino_greedy_equals_ar(request, target_fixture):
  """The embedded SmolLM2 with a random Domino drafter, 4 chat prompts (the
  first batch of test_speculative's SmolLM2 test, so AR compiles are shared),
  in both modes."""
  smollm2 = request.getfixturevalue(target_fixture)
  drafter = dj.DFlashDrafter.init(smollm2, block_size=4, num_layers=1, domino=True,
                                  seed=0)
  batch = SMOLLM2_PROMPTS[:4]
  ar = dj.generate(smollm2, batch, max_new_tokens=12)
  sp = dj.generate(smollm2, batch, max_new_tokens=12, draft=drafter, tree="dartree",
                   tree_config=DARTreeConfig(topk=4, supertree_width=3, budget=8))
  assert sp.tokens == ar.tokens


def test_shipped_domino_drafter_is_lossless_and_drafts_well(smollm2):
  """The drafter shipped for the embedded SmolLM2 with its measured tree: every
  DARTree method gives plain greedy decoding's tokens on 4 chat prompts, and the
  trained drafter gets more than one token per round (a random drafter's chains
  get about 1.0 here)."""
  drafter = dj.load_domino(target=smollm2)
  assert drafter.domino and drafter.tree_config is not None
  batch = SMOLLM2_PROMPTS[:4]
  ar = dj.generate(smollm2, batch, max_new_tokens=16)
  accept = {}
  for method in ("dflash-chain", "domino-chain", "ddtree", "dartree-fixed", "dartree"):
    sp = dj.generate(smollm2, batch, max_new_tokens=16, draft=drafter, tree=method)
    assert sp.tokens == ar.tokens, method
    accept[method] = sp.stats.mean_accept_len
  assert accept["dartree"] > 1.15 and accept["domino-chain"] > 1.15, accept
