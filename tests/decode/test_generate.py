"""The generate driver: prompt forms, batching, streaming, stop rules, bad input."""


import importlib

import numpy as np
import pytest

import dart_jax as dj
from dart_jax.decode.ar import ARDecoder
from dart_jax.generate import attend_bucket, encode_prompts, kept_batch_size
from dart_jax.models.transformer import KVCache
from dart_jax.ngram import NGram
from dart_jax.sampling import SamplingConfig, processed_log_probs
from tests.helpers import FIXTURES



@pytest.fixture(scope="module")
def target():
  return dj.load_target(FIXTURES / "tiny_llama")


def test_prompt_forms(target):
  tok = target.tokenizer
  ids, batch = encode_prompts(target, "Hello there")
  assert not batch and ids == [tok.encode_chat("Hello there")]
  ids, batch = encode_prompts(target, "Hello there", chat=False)
  assert ids == [tok.encode("Hello there")]
  ids, batch = encode_prompts(target, ["Hi", "Bye"])
  assert batch and ids == [tok.encode_chat("Hi"), tok.encode_chat("Bye")]
  ids, batch = encode_prompts(target, [5, 6, 7])
  assert not batch and ids == [[5, 6, 7]]
  ids, batch = encode_prompts(target, [[5, 6], [7]])
  assert batch and ids == [[5, 6], [7]]
  messages = [{"role": "user", "content": "Hi"}]
  ids, batch = encode_prompts(target, messages)
  assert not batch and ids == [tok.encode_chat(messages)]


def test_batch_equals_single_and_text_decodes_tokens(target):
  prompts = ["Hello there, how are you?", "Tell me about the sea", "Hi"]
  out = dj.generate(target, prompts, max_new_tokens=9, eos_token_ids=())
  assert [len(t) for t in out.tokens] == [9, 9, 9]
  for p, toks, text in zip(prompts, out.tokens, out.text):
    single = dj.generate(target, p, max_new_tokens=9, eos_token_ids=())
    assert single.tokens == toks
    assert text == target.tokenizer.decode(toks)


def test_stream_concatenates_to_text(target):
  out = dj.generate(target, "Hello there, how are you?", max_new_tokens=12, eos_token_ids=())
  chunks = list(dj.generate_stream(target, "Hello there, how are you?", max_new_tokens=12,
                                   eos_token_ids=()))
  assert "".join(chunks) == out.text and len(chunks) > 1


def test_eos_stops_and_is_kept(target):
  free = dj.generate(target, [3, 4, 5], max_new_tokens=12, eos_token_ids=()).tokens
  eos = free[4]
  out = dj.generate(target, [3, 4, 5], max_new_tokens=12, eos_token_ids=(eos,))
  assert out.tokens == free[:free.index(eos) + 1]


def test_stats(target):
  out = dj.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=6, eos_token_ids=())
  s = out.stats
  assert s.new_tokens == 12 and s.rounds == 5 and s.mean_accept_len == 1.0
  assert s.tokens_per_s > 0 and s.time_to_first_token_s > 0


def test_stats_separate_compile_time(target):
  """A batch size never decoded before compiles a new step: its seconds are counted
  in compile_s; the same call again compiles nothing."""
  prompts = [[1, 2, 3]] * 7
  cold = dj.generate(target, prompts, max_new_tokens=5, eos_token_ids=()).stats
  warm = dj.generate(target, prompts, max_new_tokens=5, eos_token_ids=()).stats
  assert 0 < cold.compile_s < cold.total_s and warm.compile_s == 0


def test_bad_input(target):
  with pytest.raises(dj.InputError, match="empty"):
    dj.generate(target, "")
  with pytest.raises(dj.InputError, match="empty"):
    dj.generate(target, [])
  with pytest.raises(dj.InputError, match="vocabulary"):
    dj.generate(target, [1, 99999])
  with pytest.raises(dj.InputError, match="does not fit"):
    dj.generate(target, [1] * 600)  # max_position_embeddings is 512
  with pytest.raises(dj.InputError, match="max_new_tokens"):
    dj.generate(target, [1, 2], max_new_tokens=0)
  with pytest.raises(dj.InputError, match="temperature"):
    dj.generate(target, [1, 2], temperature=-0.5)
  with pytest.raises(dj.InputError, match="top_k"):
    dj.generate(target, [1, 2], temperature=1.0, top_k=-1)


def test_generation_stops_at_max_length(target):
  out = dj.generate(target, [1] * 20, max_new_tokens=50, max_length=30, eos_token_ids=())
  assert 1 <= len(out.tokens) <= 10


def test_kept_batch_size():
  # Multiples of 8, and only when that drops a quarter of the rows or more.
  assert kept_batch_size(65, 128) == 72 and kept_batch_size(96, 128) == 96
  assert kept_batch_size(97, 128) == 128  # 104 rows would drop less than a quarter
  assert kept_batch_size(20, 128) == 24 and kept_batch_size(1, 128) == 8
  assert kept_batch_size(9, 20) == 20 and kept_batch_size(8, 20) == 8
  assert kept_batch_size(3, 12) == 8 and kept_batch_size(3, 10) == 10
  assert kept_batch_size(0, 3) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dropping_finished_sequences_changes_no_token(target, monkeypatch, temperature):
  # Prompts of 10..49 tokens in a 64-row cache run out of room one after another,
  # so the batch of 40 shrinks to 24, 16 and then 8 sequences.
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 200, size=10 + i).tolist() for i in range(40)]
  run = lambda: dj.generate(target, prompts, max_new_tokens=60, max_length=64,
                            temperature=temperature, seed=3, eos_token_ids=()).tokens
  sizes = []
  keep_rows = ARDecoder.keep_rows
  def recording_keep_rows(self, state, slots):
    sizes.append(len(slots))
    return keep_rows(self, state, slots)
  monkeypatch.setattr(ARDecoder, "keep_rows", recording_keep_rows)
  dropped = run()
  assert sizes == [24, 16, 8]
  # `dart_jax.generate` as an attribute is the function, so import the module by name.
  generate_module = importlib.import_module("dart_jax.generate")
  monkeypatch.setattr(generate_module, "_KEPT_BATCH_STEP", 10**6)  # never shrink
  kept = run()
  assert sizes == [24, 16, 8]
  assert dropped == kept
  assert len({len(t) for t in kept}) > 10  # the rows really ended at different times


def test_a_grown_cache_keeps_its_entries():
  cache = KVCache.create(2, batch=3, capacity=8, num_kv_heads=2, head_dim=4,
                         layout="bhsd")
  filled = cache.replace(k=tuple(b + 1.0 for b in cache.k))
  grown = filled.grow(20)
  assert grown.capacity == 20 and grown.k[1].shape == (3, 2, 20, 4)
  np.testing.assert_array_equal(grown.k[1][:, :, :8], filled.k[1])
  assert not np.asarray(grown.k[1][:, :, 8:]).any()
  with pytest.raises(ValueError, match="cannot shrink"):
    grown.grow(10)


@pytest.mark.parametrize("method", ["ar", "dart"])
def test_growing_caches_changes_no_token(target, monkeypatch, method):
  # 50-token prompts and 40 new tokens: the attention window goes 64 -> 128 rows,
  # so the caches start at 64 + scratch rows and grow once.
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 200, size=48 + i).tolist() for i in range(3)]
  kwargs = {}
  if method == "dart":
    head = dj.DartHead.init(target, draft_length=3, draft_vocab_size=60, seed=4)
    kwargs = dict(draft=head, ngram=NGram.build(prompts, order=3))
  run = lambda: dj.generate(target, prompts, max_new_tokens=40, max_length=512,
                            eos_token_ids=(), **kwargs).tokens
  generate_module = importlib.import_module("dart_jax.generate")
  grown = []
  grow_caches = generate_module.grow_caches
  def recording_grow_caches(state, extra_rows):
    grown.append(extra_rows)
    return grow_caches(state, extra_rows)
  monkeypatch.setattr(generate_module, "grow_caches", recording_grow_caches)
  growing = run()
  assert grown == [64]
  monkeypatch.setattr(generate_module, "grows_caches", lambda target: False)
  assert run() == growing and grown == [64]


def test_attend_bucket():
  assert attend_bucket(1, 4096) == 64
  assert attend_bucket(65, 4096) == 128
  assert attend_bucket(3000, 2048) == 2048


def test_top_p_top_k_processing():
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  keep = np.isfinite(np.asarray(processed_log_probs(logits, SamplingConfig(1.0, 0.7, 0))))
  assert keep.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
  keep = np.isfinite(np.asarray(processed_log_probs(logits, SamplingConfig(1.0, 1.0, 3))))
  assert keep.tolist() == [[True, True, True, False]]
  probs = np.exp(np.asarray(processed_log_probs(logits, SamplingConfig(0.5, 0.9, 2))))
  np.testing.assert_allclose(probs, [[0.25 / 0.34, 0.09 / 0.34, 0, 0]], atol=1e-6)
