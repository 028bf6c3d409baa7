"""Training data: formats, loss masks, bad input, packing, vocabulary, iteration,
regeneration."""

import collections
import dataclasses
import json
import logging
import os

import numpy as np
import pytest

from dart_jax.errors import CheckpointError, InputError
from dart_jax.io import Tokenizer
from train import data as data_lib
from train.configs import DataSection, SAMPLE_DATA, TINY_TARGET

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "2 plus 2 is 4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "It is 6."}]
SHAREGPT = {"conversations": [{"from": {"system": "system", "user": "human",
                                        "assistant": "gpt"}[m["role"]],
                               "value": m["content"]} for m in CONV]}


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_dir(TINY_TARGET)


def _write(path, lines):
  with open(path, "w", encoding="utf-8") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return str(path)


def test_sample_data_is_bundled_small_and_in_both_formats():
  total = 0
  for path in SAMPLE_DATA:
    total += os.path.getsize(path)
    with open(path) as f:
      first = json.loads(f.readline())
    assert "conversations" in first or "messages" in first
  assert total < 1_000_000
  stats = data_lib.DataStats()
  assert len(data_lib.read_records(SAMPLE_DATA, stats)) >= 300 and stats.malformed == 0


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_compressed_jsonl_reads_like_the_plain_file(tmp_path, suffix):
  import gzip, lzma
  opener = {".xz": lzma.open, ".gz": gzip.open}[suffix]
  plain = _write(tmp_path / "plain.jsonl", [SHAREGPT, {"messages": CONV}, "not json"])
  packed = tmp_path / f"packed.jsonl{suffix}"
  with open(plain, "rb") as src, opener(packed, "wb") as dst:
    dst.write(src.read())
  plain_stats, packed_stats = data_lib.DataStats(), data_lib.DataStats()
  assert (data_lib.read_records([str(packed)], packed_stats)
          == data_lib.read_records([plain], plain_stats))
  assert packed_stats.malformed == plain_stats.malformed == 1


def test_a_truncated_compressed_file_is_a_clear_error(tmp_path):
  import lzma
  body = "".join(json.dumps({"messages": CONV}) + "\n" for _ in range(200)).encode()
  blob = lzma.compress(body)
  path = tmp_path / "cut.jsonl.xz"
  path.write_bytes(blob[:len(blob) // 2])
  with pytest.raises(InputError, match="not a complete compressed file"):
    data_lib.read_records([str(path)], data_lib.DataStats())


def test_sharegpt_and_openai_give_the_same_tokens_and_assistant_mask(tokenizer):
  openai = data_lib.record_to_messages({"messages": CONV})
  sharegpt = data_lib.record_to_messages(SHAREGPT)
  assert openai == sharegpt == CONV
  ex = data_lib.tokenize_chat(tokenizer, openai)
  text = tokenizer.apply_chat_template(CONV, add_generation_prompt=False)
  assert tokenizer.decode(ex.tokens.tolist(), skip_special_tokens=False) == text
  # The targets are exactly the two answers, each with its end-of-turn token.
  targets = tokenizer.decode(ex.tokens[ex.loss_mask].tolist(), skip_special_tokens=False)
  assert targets == "2 plus 2 is 4.<|im_end|>It is 6.<|im_end|>"
  # Contiguous runs: one per assistant turn.
  runs = np.flatnonzero(np.diff(np.concatenate([[0], ex.loss_mask.astype(int), [0]])) == 1)
  assert len(runs) == 2


def test_assistant_text_repeating_the_question_is_masked_in_the_answer(tokenizer):
  conv = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "hello"}]
  ex = data_lib.tokenize_chat(tokenizer, conv)
  text = tokenizer.decode(ex.tokens[ex.loss_mask].tolist(), skip_special_tokens=False)
  assert text == "hello<|im_end|>"
  # The masked tokens are at the end, not inside the user turn.
  assert ex.loss_mask[-3:].any() and not ex.loss_mask[:5].any()


def test_plain_text_records_train_on_every_token(tokenizer):
  ex = data_lib.tokenize_text(tokenizer, data_lib.record_to_messages({"text": "hello world"}))
  assert ex.loss_mask.all() and tokenizer.decode(ex.tokens.tolist()) == "hello world"


def test_malformed_lines_are_counted_and_skipped_with_a_warning(tmp_path, tokenizer, caplog):
  path = _write(tmp_path / "mixed.jsonl", [
      {"messages": CONV},
      "{not json",
      "[1, 2, 3]",
      {"conversations": [{"from": "alien", "value": "hi"}]},
      {"messages": [{"role": "user", "content": 5}]},
      {"foo": "bar"},
      "",
      SHAREGPT,
  ])
  with caplog.at_level(logging.WARNING):
    prepared = data_lib.prepare_data(
        DataSection(train=(path,), eval_fraction=0.0, max_len=64), tokenizer)
  assert prepared.stats.malformed == 5
  assert prepared.stats.records == 2
  assert "skipped 5 malformed" in caplog.text and "mixed.jsonl:2" in caplog.text
  assert len(prepared.train) >= 1


def test_data_without_assistant_tokens_is_a_clear_error(tmp_path, tokenizer):
  path = _write(tmp_path / "users.jsonl",
                [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)])
  with pytest.raises(InputError, match="no assistant tokens"):
    data_lib.prepare_data(DataSection(train=(path,), eval_fraction=0.0), tokenizer)
  empty = _write(tmp_path / "bad.jsonl", ["{oops", "[]"])
  with pytest.raises(InputError, match="no well-formed records"):
    data_lib.prepare_data(DataSection(train=(empty,)), tokenizer)
  with pytest.raises(InputError, match="not found"):
    data_lib.prepare_data(DataSection(train=(str(tmp_path / "missing.jsonl"),)), tokenizer)


def test_packing_segments_positions_and_truncation():
  ex = lambda n, m: data_lib.Example(np.arange(1, n + 1, dtype=np.int32), np.array(m, bool))
  stats = data_lib.DataStats()
  examples = [ex(4, [0, 1, 1, 1]), ex(3, [0, 0, 1]), ex(6, [0, 1, 1, 1, 1, 1]),
              ex(3, [0, 0, 0])]  # the last has no target: dropped
  rows = data_lib.pack_examples(examples, 5, pack=True, stats=stats)
  assert stats.truncated == 1
  np.testing.assert_array_equal(rows.segment_ids, [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0],
                                                   [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(rows.positions[2], [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(rows.tokens[2], [1, 2, 3, 4, 5])
  rows = data_lib.pack_examples(examples[:2], 8, pack=True)
  np.testing.assert_array_equal(rows.segment_ids, [[1, 1, 1, 1, 2, 2, 2, 0]])
  np.testing.assert_array_equal(rows.positions, [[0, 1, 2, 3, 0, 1, 2, 0]])
  np.testing.assert_array_equal(rows.loss_mask, [[0, 1, 1, 1, 0, 0, 1, 0]])
  assert len(data_lib.pack_examples(examples[:2], 8, pack=False)) == 2


def test_draft_vocab_is_the_most_frequent_target_tokens_sorted():
  tokens = np.array([[5, 5, 5, 7, 7, 2, 9, 9, 9, 9]], np.int32)
  loss_mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], bool)  # 9 is not a target
  rows = data_lib.Rows(tokens, loss_mask, np.ones_like(tokens), np.zeros_like(tokens))
  np.testing.assert_array_equal(data_lib.select_draft_vocab(rows, 12, 2), [5, 7])
  np.testing.assert_array_equal(data_lib.select_draft_vocab(rows, 12, 3), [2, 5, 7])
  # Fewer distinct targets than Vd: then other tokens of the rows, then small ids.
  np.testing.assert_array_equal(data_lib.select_draft_vocab(rows, 12, 5), [0, 2, 5, 7, 9])


def _rows(n):
  t = np.arange(n, dtype=np.int32)[:, None] * np.ones((1, 4), np.int32)
  return data_lib.Rows(t, np.ones_like(t, bool), np.ones_like(t), np.zeros_like(t))


def test_iterator_is_deterministic_resumable_and_sharded_by_process():
  rows = _rows(10)
  first = [next(data_lib.BatchIterator(rows, 4, seed=3))["tokens"][:, 0] for _ in range(2)]
  np.testing.assert_array_equal(first[0], first[1])
  it = data_lib.BatchIterator(rows, 4, seed=3)
  seen = np.concatenate([next(it)["tokens"][:, 0] for _ in range(5)])  # 20 = 2 epochs
  assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
  assert list(seen[:10]) != list(range(10))  # shuffled
  state = it.get_state()
  after = [next(it)["tokens"][:, 0] for _ in range(3)]
  resumed = data_lib.BatchIterator(rows, 4, seed=3)
  resumed.set_state(json.loads(json.dumps(state)))
  for expected in after:
    np.testing.assert_array_equal(next(resumed)["tokens"][:, 0], expected)
  # Two processes: their halves make up the single-process global batch.
  single = data_lib.BatchIterator(rows, 4, seed=3)
  p0 = data_lib.BatchIterator(rows, 4, seed=3, process_index=0, process_count=2)
  p1 = data_lib.BatchIterator(rows, 4, seed=3, process_index=1, process_count=2)
  for _ in range(3):
    both = np.concatenate([next(p0)["tokens"][:, 0], next(p1)["tokens"][:, 0]])
    np.testing.assert_array_equal(both, next(single)["tokens"][:, 0])
  with pytest.raises(CheckpointError, match="num_rows"):
    data_lib.BatchIterator(_rows(11), 4, seed=3).set_state(state)


def test_eval_batches_are_fixed_and_padded():
  batches = data_lib.eval_batches(_rows(5), 4, max_batches=3)
  assert len(batches) == 2
  np.testing.assert_array_equal(batches[1]["tokens"][:, 0], [4, 0, 0, 0])
  np.testing.assert_array_equal(batches[1]["segment_ids"][1:], 0)


def test_prepared_data_is_cached(tmp_path, tokenizer, monkeypatch):
  config = DataSection(train=SAMPLE_DATA, max_len=128)
  a = data_lib.prepare_data(config, tokenizer, str(tmp_path))
  suffixes = sorted(name.split(".", 1)[1] for name in os.listdir(tmp_path))
  assert suffixes == ["eval.npz", "json", "train.npz"]

  def no_tokenizing(*args, **kwargs):
    raise AssertionError("the cache was not used")

  monkeypatch.setattr(data_lib, "tokenize_records", no_tokenizing)
  b = data_lib.prepare_data(config, tokenizer, str(tmp_path))
  np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
  assert dataclasses.asdict(a.stats) == dataclasses.asdict(b.stats)
  assert a.eval is not None and len(a.eval) >= 1


def test_regenerate_replaces_answers_and_resumes_exactly(tmp_path):
  import dart_jax as dj

  target = dj.load_target(TINY_TARGET)
  convs = [{"messages": [{"role": "user", "content": "What is 2 plus 3?"},
                         {"role": "assistant", "content": "ORIGINAL"},
                         {"role": "user", "content": "And if you add 10 to that?"},
                         {"role": "assistant", "content": "ORIGINAL"}]},
           SHAREGPT,
           {"messages": [{"role": "assistant", "content": "no user turn"}]},
           {"messages": [{"role": "user", "content": "Hello there."}]},
           "{broken"]
  src = _write(tmp_path / "in.jsonl", convs)
  kwargs = dict(max_new_tokens=4, batch_size=2, temperature=0.0, progress=False)
  full = data_lib.regenerate(target, [src], str(tmp_path / "full.jsonl"), **kwargs)
  counts = {k: full.pop(k) for k in ("new_tokens", "generate_s", "tokens_per_s")}
  assert full == {"written": 3, "skipped": 1, "unanswered": 0, "malformed": 1,
                  "batches_done": 2, "batches_total": 2}
  assert counts["generate_s"] > 0
  # The rate is rounded to 0.1 from the unrounded seconds, reported rounded to 1 ms.
  rate = counts["new_tokens"] / counts["generate_s"]
  assert counts["tokens_per_s"] == pytest.approx(
      rate, abs=0.05 + rate * 0.0005 / counts["generate_s"] + 1e-9)
  part = str(tmp_path / "part.jsonl")
  first = data_lib.regenerate(target, [src], part, max_batches=1, **kwargs)
  assert first["written"] == 2 and first["batches_done"] == 1
  with open(part, "a") as f:
    f.write('{"messages": [{"role": "user", "con')  # killed mid-line
  rc = data_lib.main(["regenerate", "--model", TINY_TARGET, "--data", src, "--out", part,
                      "--max-new-tokens", "4", "--batch-size", "2"])
  assert rc == 0
  with open(tmp_path / "full.jsonl") as f:
    full_lines = f.read()
  with open(part) as f:
    assert f.read() == full_lines
  lines = [json.loads(x) for x in full_lines.splitlines()]
  assert [x["index"] for x in lines] == [0, 1, 3]
  # Every answer is 1..4 new tokens (max_new_tokens=4).
  answers = sum(m["role"] == "assistant" for x in lines for m in x["messages"])
  assert answers <= counts["new_tokens"] <= 4 * answers
  roles = [m["role"] for m in lines[0]["messages"]]
  assert roles == ["user", "assistant", "user", "assistant"]
  assert all(m["content"] != "ORIGINAL" for m in lines[0]["messages"])
  assert lines[1]["messages"][0] == {"role": "system", "content": "Be brief."}
  assert lines[2]["messages"][-1]["role"] == "assistant"
  # Greedy answers are the target's own continuation of the same prompt.
  alone = dj.generate(target, [lines[2]["messages"][:1]], max_new_tokens=4)
  assert lines[2]["messages"][1]["content"] == alone.text[0]


def test_regenerate_grouped_by_length_batches_equal_turn_counts(tmp_path):
  import dart_jax as dj

  target = dj.load_target(TINY_TARGET)
  two_turns = lambda q: {"messages": [{"role": "user", "content": q},
                                      {"role": "user", "content": "Say more."}]}
  one_turn = lambda q: {"messages": [{"role": "user", "content": q}]}
  convs = [two_turns("What is 2 plus 3?"), one_turn("Hi."), two_turns("Name a colour."),
           one_turn("Tell me a long story about a very old and very tired dragon.")]
  src = _write(tmp_path / "in.jsonl", convs)
  kwargs = dict(max_new_tokens=3, batch_size=2, temperature=0.0, progress=False)
  out = str(tmp_path / "grouped.jsonl")
  result = data_lib.regenerate(target, [src], out, group_by_length=True, **kwargs)
  assert result["written"] == 4
  with open(out) as f:
    lines = [json.loads(x) for x in f]
  # One-turn prompts first, shorter first, then the two-turn pair, shorter first.
  assert [(x["index"], x["batch"]) for x in lines] == [(1, 0), (3, 0), (2, 1), (0, 1)]
  plain = str(tmp_path / "plain.jsonl")
  data_lib.regenerate(target, [src], plain, **kwargs)
  with open(plain) as f:
    by_index = {x["index"]: x["messages"] for x in map(json.loads, f)}
  # Greedy answers do not depend on the batch a conversation landed in.
  assert all(by_index[x["index"]] == x["messages"] for x in lines)


def test_regenerate_batch_slices_answer_disjoint_prompts(tmp_path):
  import dart_jax as dj

  target = dj.load_target(TINY_TARGET)
  convs = [{"messages": [{"role": "user", "content": f"Count to {n}."}]} for n in range(5)]
  src = _write(tmp_path / "in.jsonl", convs)
  kwargs = dict(max_new_tokens=2, batch_size=2, temperature=1.0, seed=3, progress=False)
  full = str(tmp_path / "full.jsonl")
  data_lib.regenerate(target, [src], full, **kwargs)
  head, tail = str(tmp_path / "head.jsonl"), str(tmp_path / "tail.jsonl")
  data_lib.regenerate(target, [src], head, last_batch=1, **kwargs)
  result = data_lib.regenerate(target, [src], tail, first_batch=1, **kwargs)
  assert result["written"] == 3 and result["batches_done"] == 3
  read = lambda p: [json.loads(x) for x in open(p)]
  assert [x["index"] for x in read(head)] == [0, 1]
  assert [x["index"] for x in read(tail)] == [2, 3, 4]
  # A slice samples each batch with its own seed: the pieces are the full run.
  assert read(head) + read(tail) == read(full)
  # Rerunning a finished slice answers nothing new.
  again = data_lib.regenerate(target, [src], tail, first_batch=1, **kwargs)
  assert again["new_tokens"] == 0 and read(tail) == read(full)[2:]
  with pytest.raises(dj.InputError, match="is empty"):
    data_lib.regenerate(target, [src], str(tmp_path / "x.jsonl"), first_batch=3, **kwargs)


def test_bundled_v2_data_answers_the_recipe_prompts_and_holds_out_its_split():
  """The bundled v2 files (train/README.md) answer exactly the prompts their
  recipe generates, the held-out split shares no prompt with the training sets,
  the greedy and sampled sets answer different prompts, and no MT-Bench turn
  appears."""
  from infer import datasets
  from train import configs, prompts

  train_prompts, heldout_prompts = prompts.split_heldout(
      prompts.generate_prompts(12400, seed=0, recipe="v2"), 400)

  def read(path):
    stats = data_lib.DataStats()
    records = [r for _, r in data_lib.read_jsonl(path, stats)]
    assert records and stats.malformed == 0, path
    return records

  def users(record):
    return [m["content"] for m in record["messages"] if m["role"] == "user"]

  heldout = read(configs.SMOLLM2_V2_HELDOUT)
  greedy, sampled, sampled_more = (read(p) for p in configs.SMOLLM2_V2_TRAIN)
  # The second sampled file continues the first one's batch plan.
  assert max(r["batch"] for r in sampled) < min(r["batch"] for r in sampled_more)
  assert all(n == 128 for n in collections.Counter(
      r["batch"] for r in sampled + sampled_more).values())  # whole batches only
  sampled = sampled + sampled_more
  for records, source in ((heldout, heldout_prompts), (greedy, train_prompts),
                          (sampled, train_prompts)):
    for r in records:
      asked = [m["content"] for m in source[r["index"]]["messages"]]
      # Every answered conversation is its prompt's (a prefix of its turns when
      # a follow-up would not fit).
      assert users(r) and users(r) == asked[:len(users(r))], r["index"]
    answered = sum(any(m["role"] == "assistant" and m["content"].strip()
                       for m in r["messages"]) for r in records)
    assert answered >= 0.99 * len(records)
  assert len(heldout) == 400
  assert not {r["index"] for r in greedy} & {r["index"] for r in sampled}
  heldout_firsts = {users(r)[0] for r in heldout}
  assert not heldout_firsts & {users(r)[0] for r in greedy + sampled}
  bench = {t.strip() for q in datasets.load_mt_bench() for t in q.turns}
  assert not bench & {u.strip() for r in heldout + greedy + sampled for u in users(r)}


def test_resume_reads_answers_holding_unicode_line_separators(tmp_path):
  """Answers are written with raw non-ASCII; U+2028 / U+0085 inside a JSON string
  are not line ends (a resumed run failed on one)."""
  records = [{"index": 0, "messages": [{"role": "assistant", "content": "a\u2028b\x85c"}]},
             {"index": 1, "messages": []}]
  path = tmp_path / "out.jsonl"
  body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  path.write_bytes((body + '{"index": 2, "mess').encode("utf-8"))
  assert data_lib._complete_lines(str(path)) == records
  assert path.read_bytes() == body.encode("utf-8")  # the partial line is cut off
