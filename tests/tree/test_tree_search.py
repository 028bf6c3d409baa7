"""Jitted DART search vs the numpy reference on many random cases.

Each comparison runs both implementations: the XLA search (`dart_search`,
`search_candidates`) and the CPU kernel's (`search_batch` where the kernels
run, one FFI call for the batch; skipped where they do not). Two comparisons:
- exact arithmetic (integer log-probabilities, unit weights): the float work
  is exact in both implementations, so the trees must be identical node for
  node, which pins down every tie-breaking rule;
- random float cases (random logits, vocab 64..50k, random N-gram data, d2t,
  EOS, short contexts): the jitted version uses XLA's log/exp and fused
  multiply-adds, so scores may differ from numpy in the last bits. Whenever
  the reference's smallest cut margin exceeds that noise, the node sets must
  be equal; cases with a near-tie at a cut are counted and must stay rare.
"""

import functools
import zlib

import jax
import numpy as np
import pytest

from dart_jax.models import precision
from dart_jax.ngram import NGram
from dart_jax.tree import (TreeConfig, dart_search, level_candidates, search_batch,
                           search_candidates)
from kernels import cpu_matmul
from dart_jax.tree.reference import (reference_search,
                                     reference_search_candidates)
from tests.tree.test_tree import check_tree_properties, tree_paths, unit_weight

# Scores agree to ~1e-5 (measured max ~4e-6); a larger cut margin cannot flip.
SCORE_ATOL = 1e-4
MARGIN = 3e-4

xla_search = jax.jit(dart_search, static_argnames=("config",))
xla_search_from_candidates = jax.jit(search_candidates, static_argnames=("config",))


@functools.partial(jax.jit, static_argnames=("config",))
def kernel_search_from_candidates(tokens, log_probs, context, ngram, config,
                                  context_len=None):
  """`search_batch` on one sequence, traced with the CPU kernels on."""
  with precision.cpu_kernel(True):
    tree = search_batch(tokens[None], log_probs[None], context[None], ngram, config,
                        None if context_len is None else context_len[None])
  return jax.tree_util.tree_map(lambda x: x[0], tree)


@functools.partial(jax.jit, static_argnames=("config",))
def kernel_search(logits, context, ngram, config, d2t=None, context_len=None):
  tokens, log_probs = level_candidates(logits, config, d2t)
  return kernel_search_from_candidates(tokens, log_probs, context, ngram, config,
                                       context_len)


IMPLEMENTATIONS = {
    "xla": (xla_search, xla_search_from_candidates),
    "kernel": (kernel_search, kernel_search_from_candidates),
}
implementations = pytest.mark.parametrize("impl", [
    "xla", pytest.param("kernel", marks=pytest.mark.skipif(
        not cpu_matmul.available(), reason="the CPU kernels are not built here"))])


def half_weight(level: int) -> float:
  del level
  return 0.5


def random_ngram(rng, vocab: int, order: int) -> NGram:
  """Zipf-distributed data over a few hundred token ids (many hits)."""
  sequences = [np.minimum(rng.zipf(1.4, size=rng.integers(50, 400)) - 1,
                          vocab - 1) for _ in range(30)]
  return NGram.build(sequences, order=order)


# (name, config, levels, vocab, n-gram order or None, use d2t, cases)
GROUPS = [
    ("reference_defaults", TreeConfig(eos_id=2), 8, 49152, 3, True, 4),
    ("small_eos", TreeConfig(topk=4, beam_width=3, remain_total=10, eos_id=1),
     5, 64, 3, False, 50),
    ("chain", TreeConfig(topk=1, beam_width=1, remain_total=5, eos_id=0),
     6, 64, 2, False, 20),
    ("wide_beam", TreeConfig(topk=8, beam_width=16, remain_total=40,
                             ngram_weight=1.0, eos_id=3), 6, 300, 4, True, 40),
    ("budget_exceeds_nodes", TreeConfig(topk=3, beam_width=2, remain_total=100),
     3, 64, 3, False, 30),
    ("zero_ngram_weight", TreeConfig(topk=6, beam_width=4, remain_total=20,
                                     ngram_weight=0.0), 4, 50000, 3, False, 30),
    ("no_ngram", TreeConfig(topk=10, beam_width=5, remain_total=30, eos_id=4,
                            level_weight=half_weight), 5, 4096, None, True, 40),
]


@implementations
@pytest.mark.parametrize("group", GROUPS, ids=[g[0] for g in GROUPS])
def test_jitted_search_matches_reference(group, impl):
  search, _ = IMPLEMENTATIONS[impl]
  name, config, levels, vocab, order, use_d2t, cases = group
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  ngram = random_ngram(rng, 400, order) if order else None
  table = ngram.to_table() if ngram else None
  context_size = 6
  ambiguous, max_score_diff = 0, 0.0
  for case in range(cases):
    logits = rng.standard_normal((levels, vocab)).astype(np.float32) * 2
    # Bias the draft towards frequent n-gram tokens so the N-gram term bites.
    logits[:, :min(40, vocab)] += rng.uniform(0, 4)
    d2t = None
    if use_d2t:  # EAGLE-style: draft ids map to a sorted subset of targets,
      # the first 40 (frequent in the n-gram data) to themselves.
      rest = rng.choice(max(2 * vocab, 1000) - 40, vocab - 40, replace=False)
      targets = np.concatenate([np.arange(40), 40 + np.sort(rest)])
      d2t = (targets - np.arange(vocab)).astype(np.int32)
    context = np.minimum(rng.zipf(1.4, size=context_size) - 1, 399).astype(
        np.int32)
    context_len = int(rng.integers(1, context_size + 1))
    tree = search(logits, context, table, config=config, d2t=d2t,
                  context_len=np.int32(context_len))
    check_tree_properties(tree, levels)
    want = reference_search(logits, context[context_size - context_len:],
                            ngram, config, d2t)
    got = tree_paths(tree)
    want_scores = dict(zip(want.paths, want.scores.tolist()))
    for path in set(got) & set(want_scores):
      diff = abs(got[path] - want_scores[path])
      max_score_diff = max(max_score_diff, diff)
      assert diff <= SCORE_ATOL, (name, case, path)
    if min(want.margins) > MARGIN:
      assert set(got) == set(want.paths), (name, case)
      assert int(tree.num_nodes) == len(want.paths)
    else:
      ambiguous += 1
  assert ambiguous <= max(1, cases // 10), (name, ambiguous)
  print(f"{name}: {cases} cases, {ambiguous} near-ties, max score diff "
        f"{max_score_diff:.2e}")


EXACT_CONFIGS = [
    TreeConfig(topk=4, beam_width=3, remain_total=12, level_weight=unit_weight,
               logit_weight=unit_weight),
    TreeConfig(topk=5, beam_width=6, remain_total=25, level_weight=unit_weight,
               logit_weight=half_weight, eos_id=2),
    TreeConfig(topk=2, beam_width=1, remain_total=7, level_weight=half_weight,
               logit_weight=unit_weight, eos_id=0),
]


@implementations
@pytest.mark.parametrize("config", EXACT_CONFIGS)
def test_exact_ties_identical_trees(config, impl):
  """Integer log-probabilities: massive exact ties, exact arithmetic."""
  _, search_from_candidates = IMPLEMENTATIONS[impl]
  rng = np.random.default_rng(config.topk)
  levels, cases = 4, 40
  for _ in range(cases):
    # Few distinct tokens per level (shared across levels) so paths and EOS
    # collide; values 0, -1, -2 so sums tie exactly.
    tokens = np.stack([rng.permutation(6)[:config.topk]
                       for _ in range(levels)]).astype(np.int32)
    log_probs = -rng.integers(0, 3, size=tokens.shape).astype(np.float32)
    context = np.array([5], np.int32)
    tree = search_from_candidates(tokens, log_probs, context, None,
                                  config=config)
    check_tree_properties(tree, levels)
    want = reference_search_candidates(tokens, log_probs, context, None, config)
    n = len(want.paths) + 1
    np.testing.assert_array_equal(tree.tokens[:n], want.tokens[:n])
    np.testing.assert_array_equal(tree.parents, want.parents)
    np.testing.assert_array_equal(tree.depth, want.depth)
    np.testing.assert_array_equal(tree.mask, want.mask)
    np.testing.assert_array_equal(tree.scores[1:n], want.scores)
    for row, leaf_path in zip(np.asarray(tree.paths), want.leaf_paths):
      np.testing.assert_array_equal(row[:len(leaf_path)], leaf_path)
