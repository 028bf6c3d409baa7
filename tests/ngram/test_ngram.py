"""Tests of dart_jax.ngram: counting, back-off, reduce, the .trie format, CLI."""

import collections
import json
import struct

import numpy as np
import pytest

from dart_jax.errors import CheckpointError, InputError
from dart_jax.ngram import NGram
from dart_jax.ngram import __main__ as cli

# A hand-made order-3 trie, deliberately NOT in BFS order and with unsorted
# child lists. (token, parent, freq, [(child_token, child_index), ...])
HAND_NODES = [
    (0, 0, 10, [(5, 3), (7, 1)]),  # 0 root
    (7, 0, 6, [(9, 2), (5, 4)]),   # 1 (7)
    (9, 1, 4, [(5, 6)]),           # 2 (7, 9)
    (5, 0, 4, [(9, 5), (7, 8)]),   # 3 (5)
    (5, 1, 2, []),                 # 4 (7, 5)
    (9, 3, 3, [(7, 7)]),           # 5 (5, 9)
    (5, 2, 4, []),                 # 6 (7, 9, 5)
    (7, 5, 1, []),                 # 7 (5, 9, 7)
    (7, 3, 1, [(9, 9)]),           # 8 (5, 7)
    (9, 8, 1, []),                 # 9 (5, 7, 9)
]


def hand_trie_bytes(nodes=HAND_NODES, order=3) -> bytes:
  out = [struct.pack("<QQ", order, len(nodes))]
  for token, parent, freq, children in nodes:
    out.append(struct.pack("<iQiQ", token, parent, freq, len(children)))
    for child_token, child_index in children:
      out.append(struct.pack("<iQ", child_token, child_index))
  return b"".join(out)


def reciprocal_ratio(count: int, context_count: int) -> np.float32:
  """The reference's float32 formula: count * (1.0f / context_count)."""
  return np.float32(count) * (np.float32(1.0) / np.float32(context_count))


@pytest.fixture
def hand_path(tmp_path):
  path = tmp_path / "hand.trie"
  path.write_bytes(hand_trie_bytes())
  return path


def naive_counts(sequences, order):
  """count(g) = windows seq[s:s+order] that begin with g."""
  counts = collections.Counter()
  for seq in sequences:
    seq = list(seq)
    for start in range(len(seq)):
      window = tuple(seq[start:start + order])
      for m in range(len(window) + 1):
        counts[window[:m]] += 1
  return counts


def all_grams(ngram):
  """{gram tuple: count} read from the trie arrays (independent walk)."""
  t = ngram.arrays
  out, stack = {}, [(0, ())]
  while stack:
    node, gram = stack.pop()
    out[gram] = int(t.counts[node])
    for e in range(t.child_start[node], t.child_start[node + 1]):
      stack.append((int(t.child_nodes[e]), gram + (int(t.child_tokens[e]),)))
  return out


# ----------------------------------------------------------------- counting
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_build_counts_every_window(order):
  rng = np.random.default_rng(order)
  sequences = [rng.integers(0, 6, size=rng.integers(0, 30)) for _ in range(12)]
  sequences.append(np.array([3]))
  ngram = NGram.build(sequences, order=order)
  expected = naive_counts(sequences, order)
  assert all_grams(ngram) == dict(expected)
  assert ngram.num_nodes == len(expected)
  assert ngram.count(()) == sum(len(s) for s in sequences)


def test_build_small_example_by_hand():
  ngram = NGram.build([[1, 2, 3, 2, 2, 1, 3, 2, 3, 1, 2]], order=3)
  # "2 3" occurs at positions 1 and 7; "3 2 3" once; "1 2" twice (the last
  # window [1, 2] is shorter than the order but still counts).
  assert ngram.count([2, 3]) == 2
  assert ngram.count([3, 2, 3]) == 1
  assert ngram.count([1, 2]) == 2
  assert ngram.count([2]) == 5
  assert ngram.count([4]) == 0
  probs, matched = ngram.probability([2, 3], [1, 2, 3])
  # Suffix (2, 3): children 2 (count 1) and 1 (count 1) of a count-2 node.
  np.testing.assert_array_equal(probs, [0.5, 0.5, 0.0])
  np.testing.assert_array_equal(matched, [2, 2, 0])


def test_build_windows_do_not_cross_sequences():
  ngram = NGram.build([[1, 2], [3, 4]], order=3)
  assert ngram.count([2, 3]) == 0
  assert ngram.count([1, 2]) == 1


def test_build_rejects_bad_input():
  with pytest.raises(InputError):
    NGram.build([[1, -2, 3]])
  with pytest.raises(InputError):
    NGram.build([[0.5, 1.0]])
  with pytest.raises(InputError):
    NGram.build([[1, 2]], order=0)


# ------------------------------------------------------------------ back-off
def test_hand_trie_back_off(hand_path):
  ngram = NGram.load_trie(hand_path)
  assert ngram.order == 3 and ngram.num_nodes == 10
  # Longest suffix (7, 9) matches 5; the 1-suffix (9) is not in the trie.
  probs, matched = ngram.probability([7, 9], [5, 7, 9, 3])
  np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0, 0.0])
  np.testing.assert_array_equal(matched, [2, 0, 0, 0])
  # (9, 7) is absent: back off to (7), a count-6 node.
  probs, matched = ngram.probability([9, 7], [9, 5, 7])
  np.testing.assert_array_equal(
      probs, [reciprocal_ratio(4, 6), reciprocal_ratio(2, 6), 0.0])
  np.testing.assert_array_equal(matched, [1, 1, 0])
  np.testing.assert_allclose(probs, [4 / 6, 2 / 6, 0.0], rtol=1e-6)
  # 9 matches at (5, 7) and keeps 1.0 (not 4/6 from (7)); 5 backs off.
  probs, matched = ngram.probability([5, 7], [9, 5])
  np.testing.assert_array_equal(probs, [1.0, reciprocal_ratio(2, 6)])
  np.testing.assert_array_equal(matched, [2, 1])
  # Only the last order-1 tokens matter.
  probs2, matched2 = ngram.probability([1, 2, 5, 7], [9, 5])
  np.testing.assert_array_equal(probs2, probs)
  np.testing.assert_array_equal(matched2, matched)
  # A context shorter than order-1 uses what exists.
  probs, matched = ngram.probability([7], [9, 5])
  np.testing.assert_array_equal(probs, [reciprocal_ratio(4, 6),
                                        reciprocal_ratio(2, 6)])
  np.testing.assert_array_equal(matched, [1, 1])
  # (5, 9) -> 7 with count 1 of 3.
  probs, _ = ngram.probability([5, 9], [7])
  assert probs[0] == reciprocal_ratio(1, 3)
  # Empty context: everything 0.
  probs, matched = ngram.probability([], [5, 7, 9])
  assert not probs.any() and not matched.any()


def test_hand_trie_reduce(hand_path):
  ngram = NGram.load_trie(hand_path).reduce(2)
  # Dropped: (5, 7) [count 1, with its child] and (5, 9, 7) [count 1]. Each
  # kept node loses the counts of the dropped subtrees below it; the root
  # starts from 0 as in the reference.
  assert all_grams(ngram) == {
      (): -2, (5,): 2, (7,): 6, (5, 9): 2, (7, 9): 4, (7, 5): 2, (7, 9, 5): 4}
  probs, matched = ngram.probability([5], [9, 7])
  np.testing.assert_array_equal(probs, [1.0, 0.0])
  np.testing.assert_array_equal(matched, [1, 0])
  probs, matched = ngram.probability([5, 9], [7])
  assert probs[0] == 0.0 and matched[0] == 0


def naive_reduce(counts: dict, threshold: int) -> dict:
  """Recursive pruning written from the spec, on a {gram: count} dict."""
  children = collections.defaultdict(list)
  for gram in counts:
    if gram:
      children[gram[:-1]].append(gram)
  kept = {}

  def visit(gram) -> int:
    removed = 0
    for child in children[gram]:
      if counts[child] >= threshold:
        kept[child] = counts[child]
        removed += visit(child)
      else:
        removed += counts[child]
    kept[gram] = kept.get(gram, 0) - removed
    return removed

  kept[()] = 0
  visit(())
  return kept


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_reduce_matches_naive(threshold):
  rng = np.random.default_rng(threshold)
  sequences = [rng.zipf(1.5, size=40) % 9 for _ in range(15)]
  ngram = NGram.build(sequences, order=3)
  expected = naive_reduce(all_grams(ngram), threshold)
  assert all_grams(ngram.reduce(threshold)) == expected


def test_reduced_zero_count_context_gives_zero_not_nan():
  # After reduce(2), (3) has count 0 and keeps child (3, 2) of count 0; the
  # reference would compute 0 * (1/0) = NaN.
  ngram = NGram.build([[1, 2, 3, 2, 2, 1, 3, 2, 3, 1, 2]], order=3).reduce(2)
  assert ngram.count([3]) == 0 and ngram.node([3, 2]) >= 0
  probs, matched = ngram.probability([2, 3], [1, 2, 3])
  np.testing.assert_array_equal(probs, [0.0, 0.0, 0.0])
  np.testing.assert_array_equal(matched, [0, 1, 0])


# ---------------------------------------------------------------- .trie file
def test_hand_trie_round_trip_is_byte_identical(hand_path, tmp_path):
  ngram = NGram.load_trie(hand_path)
  out = tmp_path / "again.trie"
  ngram.save_trie(out)
  assert out.read_bytes() == hand_path.read_bytes()


def test_built_trie_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  sequences = [rng.integers(0, 50, size=200) for _ in range(5)]
  ngram = NGram.build(sequences, order=3)
  first, second = tmp_path / "a.trie", tmp_path / "b.trie"
  ngram.save_trie(first)
  loaded = NGram.load_trie(first)
  loaded.save_trie(second)
  assert first.read_bytes() == second.read_bytes()
  # Layout check: header + 24 bytes per node + 12 per child link.
  assert first.stat().st_size == 16 + 24 * ngram.num_nodes + 12 * (
      ngram.num_nodes - 1)
  for _ in range(50):
    context = rng.integers(0, 55, size=rng.integers(0, 4))
    tokens = rng.integers(0, 55, size=20)
    p1, m1 = ngram.probability(context, tokens)
    p2, m2 = loaded.probability(context, tokens)
    np.testing.assert_array_equal(p1.view(np.int32), p2.view(np.int32))
    np.testing.assert_array_equal(m1, m2)


def test_reduced_trie_round_trip(hand_path, tmp_path):
  reduced = NGram.load_trie(hand_path).reduce(2)
  out = tmp_path / "r.trie"
  reduced.save_trie(out)
  assert all_grams(NGram.load_trie(out)) == all_grams(reduced)


def _corrupt_cases():
  good = hand_trie_bytes()
  cases = {
      "truncated in a record": good[:-5],
      "truncated header": good[:10],
      "trailing bytes": good + b"\0" * 12,
      "zero order": struct.pack("<QQ", 0, 10) + good[16:],
      "too many nodes": struct.pack("<QQ", 3, 1000) + good[16:],
      "child index out of range": hand_trie_bytes(
          [HAND_NODES[0][:3] + ([(5, 3), (7, 99)],)] + HAND_NODES[1:]),
      "parent mismatch": hand_trie_bytes(
          HAND_NODES[:4] + [(5, 2, 2, [])] + HAND_NODES[5:]),
      "token mismatch": hand_trie_bytes(
          HAND_NODES[:4] + [(6, 1, 2, [])] + HAND_NODES[5:]),
      "huge child count": hand_trie_bytes(
          HAND_NODES[:9] + [(9, 8, 1, [])])[:-24] + struct.pack(
              "<iQiQ", 9, 8, 1, 1 << 40),
  }
  # Node 9 detached from its parent and made a child of itself (a cycle).
  cyclic = [list(n) for n in HAND_NODES]
  cyclic[8][3] = []
  cyclic[9] = (9, 9, 1, [(9, 9)])
  cases["cycle"] = hand_trie_bytes([tuple(n) for n in cyclic])
  return cases


@pytest.mark.parametrize("name", sorted(_corrupt_cases()))
def test_corrupt_trie_raises(name, tmp_path):
  path = tmp_path / "bad.trie"
  path.write_bytes(_corrupt_cases()[name])
  with pytest.raises(CheckpointError, match="bad.trie"):
    NGram.load_trie(path)


def test_missing_trie_names_the_path(tmp_path):
  with pytest.raises(CheckpointError, match="nope.trie"):
    NGram.load_trie(tmp_path / "nope.trie")


# ----------------------------------------------------------------------- CLI
@pytest.fixture
def tiny_tokenizer_dir(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "</s>": 4}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  directory = tmp_path / "tok"
  directory.mkdir()
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": "</s>"}))
  return directory


def test_cli_build(tiny_tokenizer_dir, tmp_path):
  jsonl = tmp_path / "data.jsonl"
  jsonl.write_text(json.dumps({"text": "a b c a b"}) + "\n\n"
                   + json.dumps({"messages": [{"content": "c a"},
                                              {"content": "b"}]}) + "\n")
  txt = tmp_path / "more.txt"
  txt.write_text("b b a\n\nc\n")
  out = tmp_path / "out.trie"
  assert cli.main(["build", "--tokenizer", str(tiny_tokenizer_dir), "--data",
                   str(jsonl), str(txt), "--out", str(out), "--quiet"]) == 0
  documents = [[1, 2, 3, 1, 2, 4], [3, 1, 2, 4], [2, 2, 1, 4], [3, 4]]
  assert all_grams(NGram.load_trie(out)) == dict(naive_counts(documents, 3))


def test_cli_errors(tiny_tokenizer_dir, tmp_path):
  with pytest.raises(CheckpointError, match="missing_dir"):
    cli.main(["build", "--tokenizer", str(tmp_path / "missing_dir"), "--data",
              "x.txt", "--out", str(tmp_path / "o.trie"), "--quiet"])
  bad = tmp_path / "bad.jsonl"
  bad.write_text("{not json\n")
  with pytest.raises(InputError, match="bad.jsonl:1"):
    cli.main(["build", "--tokenizer", str(tiny_tokenizer_dir), "--data",
              str(bad), "--out", str(tmp_path / "o.trie"), "--quiet"])
