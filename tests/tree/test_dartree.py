"""DARTree tree builders: batched (jitted, vmapped) == sequential numpy reference.

The reference (``dart_jax.tree.dartree_reference``) works node by node in
float64; DDTree's reference is a real best-first heap search. The jitted
builders run in float32, so a case is compared exactly (same set of token
paths, scores within 1e-4) whenever the reference's smallest cut margin exceeds
float noise; near-tie cases are counted and must stay rare. Every tree is also
checked against the ``Tree`` conventions (BFS order, prefix closure, ancestor
mask, leaf paths).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dart_jax.errors import ConfigError, InputError
from dart_jax.tree import (CorrectionHead, DARTreeConfig, dartree_build, level_widths,
                           num_tree_nodes)
from dart_jax.tree.dartree import resolve_method
from dart_jax.tree.dartree_reference import (ReferenceHead, reference_chain,
                                             reference_dartree, reference_ddtree)
from tests.tree.test_tree import check_tree_properties

SCORE_ATOL = 1e-4
MARGIN = 1e-3


def random_case(rng, batch, depths, vocab, emb=6, state=5, hidden=7,
                num_uncorrected=0, logit_scale=2.0):
  """Random base logits, roots and correction heads (scaled so that the
  correction really reorders candidates)."""
  normal = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)
  head = CorrectionHead(
      z=normal(batch, depths, emb), w_state=normal(batch, state, emb, scale=0.7),
      w_out=normal(batch, emb, vocab), w_input=normal(batch, hidden, 3 * state, scale=0.7),
      w_hidden=normal(batch, state, 3 * state, scale=0.7),
      embed=normal(batch, vocab, hidden), num_uncorrected=num_uncorrected)
  logits = normal(batch, depths, vocab, scale=logit_scale)
  roots = rng.integers(0, vocab, batch).astype(np.int32)
  return logits, roots, head


@functools.lru_cache(maxsize=None)
def batched_builder(method, config):
  build = functools.partial(dartree_build, config=config, method=method)
  return jax.jit(jax.vmap(build))


def one(tree, b):
  """Case b of a batched pytree, as numpy (no per-slice device dispatch)."""
  return jax.tree.map(lambda x: np.asarray(x)[b], tree)


def tree_path_scores(tree):
  """{token path from the root: score} of a built tree (order-free)."""
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  scores, n = np.asarray(tree.scores), int(tree.num_nodes)
  seqs, out = {0: ()}, {}
  for i in range(1, n + 1):
    seqs[i] = seqs[int(parents[i])] + (int(tokens[i]),)
    out[seqs[i]] = float(scores[i])
  return out


def compare(tree, ref, num_depths):
  """Structure always; equality with the reference unless it is a near tie.

  Returns 1 for a compared case, 0 for a skipped near tie.
  """
  check_tree_properties(tree, num_depths)
  assert int(tree.num_nodes) == len(ref.tokens)
  if ref.margin < MARGIN:
    return 0
  got, want = tree_path_scores(tree), ref.paths()
  assert set(got) == set(want)
  for path, score in want.items():
    assert abs(got[path] - score) < SCORE_ATOL, (path, got[path], score)
  # Same node order (BFS, rank within depth) and parents.
  np.testing.assert_array_equal(np.asarray(tree.parents)[1:], ref.parents)
  np.testing.assert_array_equal(np.asarray(tree.depth)[1:], ref.depths)
  return 1


# Two shapes (each a compile per method, shared by all tests below):
# S1: 16 cases, D=5, V=40, K=6; S2: D=4, V=5 < K=8, 2 uncorrected depths.
S1 = dict(depths=5, vocab=40, num_uncorrected=0)
S2 = dict(depths=4, vocab=5, num_uncorrected=2)
C1 = DARTreeConfig(topk=6, supertree_width=4, budget=12)
C2 = DARTreeConfig(topk=8, supertree_width=7, budget=40, depth_bonus=0.0)
C2_FIXED = DARTreeConfig(topk=8, budget=3)  # budget < depths: the tree stops early
CASES = [  # (method, shape, config)
    ("dartree", S1, C1), ("dartree-fixed", S1, C1), ("ddtree", S1, C1),
    ("dartree", S2, C2), ("dartree-fixed", S2, C2_FIXED), ("ddtree", S2, C2),
]
BATCH = 16


def case(seed, shape, logit_scale=2.0):
  return random_case(np.random.default_rng(seed), BATCH, shape["depths"], shape["vocab"],
                     num_uncorrected=shape["num_uncorrected"], logit_scale=logit_scale)


@pytest.mark.parametrize("method,shape,config", CASES)
def test_batched_builder_equals_sequential_reference(method, shape, config):
  depths, vocab = shape["depths"], shape["vocab"]
  logits, roots, head = case(depths * 1000 + vocab, shape)
  trees = batched_builder(method, config)(logits, roots, head)
  assert trees.tokens.shape == (BATCH, num_tree_nodes(method, config, depths, vocab) + 1)
  compared = 0
  for b in range(BATCH):
    if method == "ddtree":
      ref = reference_ddtree(logits[b], roots[b], topk=config.topk, budget=config.budget)
    else:
      ref = reference_dartree(
          logits[b], roots[b], ReferenceHead.from_head(one(head, b)), topk=config.topk,
          width=config.supertree_width, budget=config.budget,
          depth_bonus=config.depth_bonus, fixed=method == "dartree-fixed")
    compared += compare(one(trees, b), ref, depths)
    assert int(trees.tokens[b, 0]) == int(roots[b])
  assert compared >= BATCH - 2, f"too many near ties: {BATCH - compared} of {BATCH}"


@pytest.mark.parametrize("method", ["dflash-chain", "domino-chain"])
def test_chains_equal_reference(method):
  logits, roots, head = case(7, S1)
  trees = batched_builder(method, C1)(logits, roots, head)
  compared = 0
  for b in range(BATCH):
    ref_head = ReferenceHead.from_head(one(head, b)) if method == "domino-chain" else None
    ref = reference_chain(logits[b], roots[b], ref_head)
    tree = one(trees, b)
    check_tree_properties(tree, S1["depths"])
    if ref.margin > MARGIN:
      compared += 1
      np.testing.assert_array_equal(np.asarray(tree.tokens)[1:], ref.tokens)
      np.testing.assert_allclose(np.asarray(tree.scores)[1:], ref.scores, atol=SCORE_ATOL)
  assert compared >= BATCH - 2


def test_correction_changes_the_tree_and_ddtree_ignores_it():
  """DARTree uses the head (a different head gives a different tree); DDTree and
  the DFlash chain do not."""
  logits, roots, head = case(3, S1)
  _, _, other = case(4, S1)
  for method, uses_head in (("dartree", True), ("dartree-fixed", True), ("ddtree", False),
                            ("dflash-chain", False), ("domino-chain", True)):
    build = batched_builder(method, C1)
    a, b = build(logits, roots, head), build(logits, roots, other)
    same = (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents))
    assert same != uses_head, method


def test_prefix_closure_and_distinct_children_under_exact_ties():
  """Exact ties everywhere: one candidate per depth takes all the mass (log-prob
  exactly 0, so with depth_bonus 0 a child's key EQUALS its parent's), the
  others tie at -1e9 among themselves; all-equal logits tie every pair. The
  index tie-break keeps every selection prefix-closed and siblings distinct."""
  _, roots, head = case(5, S2)
  head = head.replace(w_out=np.zeros(head.w_out.shape, np.float32))  # no correction
  shape = (BATCH, S2["depths"], S2["vocab"])
  peaked = np.full(shape, -1e9, np.float32)
  peaked[:, :, 2] = 0.0
  flat = np.zeros(shape, np.float32)
  for logits in (peaked, flat):
    for method, _, config in CASES[3:]:
      trees = batched_builder(method, config)(logits, roots, head)
      for b in range(BATCH):
        tree = one(trees, b)
        check_tree_properties(tree, S2["depths"])
        tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
        n = int(tree.num_nodes)
        for p in range(n + 1):
          children = tokens[1:n + 1][parents[1:n + 1] == p]
          assert len(set(children.tolist())) == len(children), (method, p)


def test_level_widths_follow_the_spec():
  config = DARTreeConfig()  # K=64, width 12, budget 64, D=15 (block 16)
  fixed = level_widths("dartree-fixed", config, 15, 151936)
  assert fixed[:2] == (5, 5) and sum(fixed) == 64 and len(fixed) == 15
  # quota = ceil(remaining budget / remaining depths), recomputed per depth.
  remaining = 64
  for d, q in enumerate(fixed):
    assert q == -(-remaining // (15 - d))
    remaining -= q
  assert level_widths("dartree", config, 15, 151936) == (12,) * 15
  assert num_tree_nodes("dartree", config, 15, 151936) == 64
  assert num_tree_nodes("dflash-chain", config, 15, 151936) == 15
  assert level_widths("ddtree", config, 3, 151936) == (64, 64, 64)
  assert level_widths("dartree", DARTreeConfig(topk=3), 3, 100) == (3, 9, 12)


def test_bad_configs_and_methods_raise_clear_errors():
  with pytest.raises(ConfigError, match="depth_bonus must be <= 0"):
    DARTreeConfig(depth_bonus=0.1)
  with pytest.raises(ConfigError, match="topk"):
    DARTreeConfig(topk=0)
  with pytest.raises(ConfigError, match="budget"):
    DARTreeConfig(budget=2.5)
  with pytest.raises(ConfigError, match="unknown DARTree method"):
    resolve_method("beam", True)
  with pytest.raises(ConfigError, match="needs the Domino correction head"):
    resolve_method("dartree", False)
  assert resolve_method("chain", True) == "domino-chain"
  assert resolve_method("chain", False) == "dflash-chain"
  with pytest.raises(InputError, match="CorrectionHead"):
    dartree_build(jnp.zeros((3, 10)), jnp.int32(0), None, method="dartree")
  with pytest.raises(InputError, match=r"\[D, V\]"):
    dartree_build(jnp.zeros((2, 3, 10)), jnp.int32(0), None, method="ddtree")


@pytest.mark.parametrize("method", ["dartree", "dartree-fixed"])
def test_tree_build_never_widens_the_whole_embedding_table(method):
  """With a bf16 embedding table (the fast mode's) the GRU must read only the
  candidates' rows: when the table sat inside the depth loop, XLA:CPU hoisted a
  float32 copy of all of it out of the loop, 35 ms per round for SmolLM2."""
  depths, vocab, hidden, emb, gru = 4, 4096, 64, 8, 16
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  head = CorrectionHead(
      z=jax.random.normal(keys[0], (depths, emb)),
      w_state=jax.random.normal(keys[1], (gru, emb)),
      w_out=jax.random.normal(keys[2], (emb, vocab)),
      w_input=jax.random.normal(keys[3], (hidden, 3 * gru)),
      w_hidden=jax.random.normal(keys[4], (gru, 3 * gru)),
      embed=jax.random.normal(keys[5], (vocab, hidden)).astype(jnp.bfloat16))
  base = jax.random.normal(keys[6], (depths, vocab))
  config = DARTreeConfig(topk=4, supertree_width=3, budget=8)
  build = jax.jit(lambda b, h: dartree_build(b, jnp.int32(1), h, config, method=method).tokens)
  hlo = build.lower(base, head).compile().as_text()
  # A buffer of the whole table in float32 (a convert inside a fusion that
  # then gathers from it is computed per gathered element and costs nothing).
  widened = [line for line in hlo.splitlines()
             if re.search(rf"= f32\[{vocab},{hidden}\]\S* (fusion|copy)\(", line)]
  assert not widened, widened
