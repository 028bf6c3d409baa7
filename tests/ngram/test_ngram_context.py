"""The context N-gram counts what a plain Python count gives, and the search uses it."""

import collections
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dart_jax.errors import ConfigError, InputError
from dart_jax.models import precision
from dart_jax.ngram import NGram
from dart_jax.ngram.context import ContextNGram, ContextNGramConfig
from dart_jax.tree import TreeConfig, dart_search, level_candidates, search_batch
from kernels import cpu_matmul

# The module (the package exports its `dart_search` function under the same name).
dart_search_module = importlib.import_module("dart_jax.tree.dart_search")
needs_kernel = pytest.mark.skipif(not cpu_matmul.available(),
                                  reason="the CPU kernels are not built here")


def _counts(seq, width):
  """(context, next) and context counts of every n-gram of seq, by context length."""
  pairs, totals = collections.Counter(), collections.Counter()
  for m in range(1, width + 1):
    for p in range(m, len(seq)):
      context = tuple(seq[p - m:p])
      pairs[context, seq[p]] += 1
      totals[context] += 1
  return pairs, totals


def _reference_probability(seq, context, token, config):
  pairs, totals = _counts(seq, config.width)
  for m in range(config.width, config.min_order - 2, -1):
    ctx = tuple(context[-m:])
    if len(ctx) == m and pairs[ctx, token]:
      return pairs[ctx, token] / totals[ctx], m + 1
  return 0.0, 0


def _reference_prediction(seq, context, config):
  for m in range(config.width, config.min_order - 2, -1):
    ctx = list(context[-m:])
    for p in range(len(seq) - 1, m - 1, -1):  # the latest occurrence wins
      if seq[p - m:p] == ctx:
        return seq[p]
  return -1


# Jitted as the decoder runs it (inside the round); op by op it took minutes.
_add = jax.jit(lambda table, history, start, count, max_count: table.add(
    history, start, count, max_count=max_count), static_argnums=4)


def _fill(histories, lengths, config, rng):
  """Counts each row's history in random chunks, as prefill + rounds do."""
  batch, width = histories.shape
  table = ContextNGram.empty(batch, width, config)
  first = np.minimum(lengths, 30)
  table = _add(table, jnp.asarray(histories), jnp.ones(batch, jnp.int32),
               jnp.asarray(first - 1, jnp.int32), 32)
  pos = first.copy()
  while (pos < lengths).any():
    step = np.minimum(lengths - pos, rng.integers(0, 7, batch))
    table = _add(table, jnp.asarray(histories), jnp.asarray(pos, jnp.int32),
                 jnp.asarray(step, jnp.int32), 6)
    pos = pos + step
  return table


@pytest.mark.parametrize("config", [ContextNGramConfig(),
                                    ContextNGramConfig(max_order=3, min_order=3),
                                    ContextNGramConfig(max_order=5, min_order=2, inject=False)],
                         ids=["order4", "order3-min3", "order5"])
def test_counts_and_predictions_match_a_python_count(config):
  rng = np.random.default_rng(0)
  histories = rng.integers(0, 5, (3, 160)).astype(np.int32)
  lengths = np.array([40, 100, 160])
  table = _fill(histories, lengths, config, rng)
  for b in range(3):
    seq = histories[b, :lengths[b]].tolist()
    row = ContextNGram(table.keys[b], table.values[b], config)
    contexts = [seq[-config.width:], rng.integers(0, 5, config.width).tolist(),
                [7] * config.width]  # the last one never occurs
    tokens = jnp.arange(6)
    probs, matched = row.probability(jnp.asarray(contexts, jnp.int32),
                                     jnp.ones((3, config.width), bool), tokens)
    predicted = row.predict(jnp.asarray(contexts, jnp.int32),
                            jnp.ones((3, config.width), bool))
    for i, context in enumerate(contexts):
      want = [_reference_probability(seq, context, t, config) for t in range(6)]
      np.testing.assert_allclose(np.asarray(probs[i]), [w[0] for w in want], rtol=1e-6)
      assert np.asarray(matched[i]).tolist() == [w[1] for w in want]
      assert int(predicted[i]) == _reference_prediction(seq, context, config)
    assert int(predicted[2]) == -1


def test_padding_tokens_are_not_context():
  """A window shorter than the table's width only matches on its real tokens."""
  config = ContextNGramConfig()
  history = np.array([[4, 1, 2, 3, 1, 2, 9, 0]], np.int32)
  table = ContextNGram.empty(1, 8, config).add(
      jnp.asarray(history), jnp.ones(1, jnp.int32), jnp.asarray([6]), max_count=8)
  row = ContextNGram(table.keys[0], table.values[0], config)
  # (1, 2) was followed by 3 then 9; with 0 in front, the trigram (0, 1, 2) never
  # occurred, but the front entry is padding, so the bigram context (1, 2) counts.
  probs, matched = row.probability(jnp.asarray([[0, 1, 2]]),
                                   jnp.asarray([[False, True, True]]), jnp.asarray([3, 9]))
  np.testing.assert_allclose(np.asarray(probs[0]), [0.5, 0.5])
  assert np.asarray(matched[0]).tolist() == [3, 3]
  assert int(row.predict(jnp.asarray([[0, 1, 2]]),
                         jnp.asarray([[False, True, True]]))[0]) == 9


def test_capacity_keeps_the_load_at_most_half():
  config = ContextNGramConfig()
  for tokens in (1, 7, 512, 1000):
    slots = config.capacity(tokens)
    assert slots & (slots - 1) == 0 and slots >= 2 * 3 * config.width * tokens


@pytest.mark.parametrize("kwargs", [dict(max_order=1), dict(min_order=1),
                                    dict(min_order=5), dict(weight=1.5),
                                    dict(draft_weight=-0.1), dict(probes=0)])
def test_bad_config_is_a_clear_error(kwargs):
  with pytest.raises(ConfigError, match="ContextNGramConfig"):
    ContextNGramConfig(**kwargs)


def _search_inputs(seed=0, levels=4, vocab=40):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(levels, vocab)).astype(np.float32))
  corpus = [rng.integers(0, vocab, 60).tolist() for _ in range(4)]
  return logits, NGram.build(corpus, order=3).to_table()


def _tree_arrays(tree):
  return [np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth, tree.scores)]


def test_a_silent_context_table_leaves_the_tree_exactly_the_reference():
  """No stored n-gram matches: every term falls back to the corpus bit for bit."""
  logits, ngram = _search_inputs()
  config = TreeConfig(topk=5, beam_width=4, remain_total=12)
  context = jnp.asarray([3, 5, 7], jnp.int32)
  empty = ContextNGram.empty(1, 32, ContextNGramConfig(inject=True, draft_weight=0.5))
  row = ContextNGram(empty.keys[0], empty.values[0], empty.config)
  plain = dart_search(logits, context, ngram, config)
  with_context = dart_search(logits, context, ngram, config, context_ngram=row)
  for a, b in zip(_tree_arrays(plain), _tree_arrays(with_context)):
    np.testing.assert_array_equal(a, b)


def test_the_copy_prediction_enters_the_tree():
  """The context repeats 11 12 13 14: after 12 13 the copy prediction 14 (outside
  the draft's top-k) is expanded, and with the draft weight it makes the tree."""
  logits, ngram = _search_inputs()
  config = TreeConfig(topk=5, beam_width=4, remain_total=12)
  top = set(np.argsort(-np.asarray(logits[0]))[:5].tolist())
  assert 14 not in top
  history = jnp.asarray([[11, 12, 13, 14, 2, 11, 12, 13]], jnp.int32)
  context = history[0, -3:]
  for inject, weight, expect in ((False, 0.5, False), (True, 0.0, False),
                                 (True, 0.5, True)):
    cfg = ContextNGramConfig(inject=inject, draft_weight=weight)
    table = ContextNGram.empty(1, 8, cfg).add(history, jnp.ones(1, jnp.int32),
                                              jnp.asarray([7]), max_count=8)
    row = ContextNGram(table.keys[0], table.values[0], cfg)
    tree = dart_search(logits, context, ngram, config, context_ngram=row)
    tokens, parents, depth = (np.asarray(x) for x in (tree.tokens, tree.parents,
                                                       tree.depth))
    at_root = tokens[(depth == 1) & (parents == 0)].tolist()
    assert (14 in at_root) == expect, (inject, weight, at_root)
    assert len(set(at_root)) == len(at_root)  # an injected token is never a duplicate


@functools.partial(jax.jit, static_argnames=("kernel", "max_count"))
def _add_with(table, history, start, count, kernel, max_count):
  with precision.cpu_kernel(kernel):
    return table.add(history, start, count, max_count=max_count)


@needs_kernel
@pytest.mark.parametrize("probes", [16, 2, 1])
def test_kernel_inserts_give_the_xla_tables_bit_for_bit(probes):
  """The kernel runs `_insert_row`'s claim rounds step for step: the same slots,
  the same drops when a probe window is full (1-2 probes force some)."""
  config = ContextNGramConfig(probes=probes)
  rng = np.random.default_rng(probes)
  batch, length = 3, 96
  history = jnp.asarray(np.minimum(rng.zipf(1.3, size=(batch, length)) - 1, 30), jnp.int32)
  tables = {kernel: ContextNGram.empty(batch, length, config) for kernel in (True, False)}
  prompt = jnp.asarray([20, 1, 40], jnp.int32)  # a prompt, then rounds of 0..6 tokens
  tables = {k: _add_with(t, history, jnp.ones(batch, jnp.int32), prompt, k, 48)
            for k, t in tables.items()}
  pos = 1 + prompt
  for _ in range(8):
    count = jnp.asarray(rng.integers(0, 7, batch), jnp.int32)
    tables = {k: _add_with(t, history, pos, count, k, 6) for k, t in tables.items()}
    pos = pos + count
  np.testing.assert_array_equal(tables[True].keys, tables[False].keys)
  np.testing.assert_array_equal(tables[True].values, tables[False].values)
  assert int((tables[True].keys != 0).sum()) > 100


@functools.partial(jax.jit, static_argnames=("config", "kernel"))
def _batch_trees(logits, context, context_len, ngram, table, config, kernel):
  tokens, log_probs = jax.vmap(lambda lg: level_candidates(lg, config))(logits)
  with precision.cpu_kernel(kernel):
    return search_batch(tokens, log_probs, context, ngram, config, context_len, table)


@needs_kernel
@pytest.mark.parametrize("config,context_config", [
    (TreeConfig(topk=5, beam_width=5, remain_total=5, eos_id=2), ContextNGramConfig()),
    (TreeConfig(topk=8, beam_width=16, remain_total=40, ngram_weight=1.0, eos_id=3),
     ContextNGramConfig(inject=False)),
    (TreeConfig(topk=3, beam_width=2, remain_total=30),
     ContextNGramConfig(max_order=3, min_order=2, weight=0.5)),
], ids=["shipped", "wide-no-inject", "order3-half"])
def test_the_kernel_search_with_a_context_table_matches_xla(config, context_config):
  """The context N-gram's terms (beyond the reference) in the kernel's search:
  the same trees as the XLA search, scores within float rounding."""
  rng = np.random.default_rng(7)
  corpus = [np.minimum(rng.zipf(1.4, size=200) - 1, 99).tolist() for _ in range(20)]
  ngram = NGram.build(corpus, order=3).to_table()
  batch, width, levels, cases, differ = 2, 8, 6, 12, 0
  for _ in range(cases):
    history = jnp.asarray(np.minimum(rng.zipf(1.3, size=(batch, 64)) - 1, 99), jnp.int32)
    table = _add_with(ContextNGram.empty(batch, 64, context_config), history,
                      jnp.ones(batch, jnp.int32), jnp.full((batch,), 63, jnp.int32),
                      True, 64)
    logits = jnp.asarray(rng.normal(size=(batch, levels, 100)).astype(np.float32) * 2)
    context = history[:, -width:]
    context_len = jnp.asarray(rng.integers(1, width + 1, batch), jnp.int32)
    got, want = (_batch_trees(logits, context, context_len, ngram, table, config, kernel)
                 for kernel in (True, False))
    same = all(np.array_equal(getattr(got, f), getattr(want, f)) for f in
               ("tokens", "parents", "depth", "mask", "paths", "num_leaves", "num_nodes"))
    differ += not same
    if same:
      np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
  assert differ <= cases // 10, differ


@needs_kernel
def test_a_context_table_wider_than_the_kernel_reads_takes_the_xla_search(monkeypatch):
  def no_kernel(*args):
    raise AssertionError("the kernel's search cannot read a context wider than 64")
  monkeypatch.setattr(dart_search_module, "_search_batch_kernel", no_kernel)
  config = TreeConfig(topk=3, beam_width=2, remain_total=6)
  table = ContextNGram.empty(1, 80, ContextNGramConfig(max_order=66))
  tokens = jnp.zeros((1, 3, 3), jnp.int32)
  with precision.cpu_kernel(True):
    tree = jax.eval_shape(lambda: search_batch(tokens, jnp.zeros((1, 3, 3)),
                                               jnp.zeros((1, 65), jnp.int32), None, config,
                                               None, table))
  assert tree.tokens.shape == (1, 7)


@needs_kernel
def test_the_kernel_search_rejects_a_context_shorter_than_the_table_reads():
  config = TreeConfig(topk=3, beam_width=2, remain_total=6)
  table = ContextNGram.empty(1, 16, ContextNGramConfig())
  with pytest.raises(InputError, match="context N-gram reads 3 tokens"):
    _batch_trees(jnp.zeros((1, 3, 10)), jnp.zeros((1, 2), jnp.int32),
                 jnp.ones((1,), jnp.int32), None, table, config, True)
