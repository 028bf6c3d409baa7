"""``generate``: the decoding driver shared by plain and speculative decoding.

A *decoder* owns the device state and one compiled function per round; this module
only prepares prompts, sizes the cache, runs rounds, emits tokens, checks stop
conditions and keeps statistics. Every decoder's round emits, per sequence, a
variable number of tokens (1 for plain decoding, the accepted path plus the bonus
token for speculative decoding); the last emitted token is the next round's root,
committed but not yet in the target's KV cache.
"""

import dataclasses
import time
from typing import Any, Iterator, Sequence

import numpy as np

from dart_jax.decode.ar import Decoder
from dart_jax.decode.methods import make_decoder
from dart_jax.errors import InputError
from dart_jax.models.target import Target
from dart_jax.models.transformer import grow_caches
from dart_jax.profiling import CompileWatch
from kernels.tree_attention.ops import resolve_impl
from dart_jax.sampling import SamplingConfig

_PROMPT_PAD = 32  # prefill lengths are padded to a multiple of this (fewer compiles)
_MIN_ATTEND = 64  # smallest cache window a round reads
_CAPACITY_STEP = 256  # cache capacities are multiples of this (fewer compiles)
_KEPT_BATCH_STEP = 8  # a batch shrinks to a multiple of this many sequences ...
_KEPT_BATCH_SHRINK = 0.75  # ... once that drops at least a quarter of its rows


def cache_rows(attend_len: int, scratch_rows: int, capacity: int) -> int:
  """Cache rows a round that reads ``attend_len`` rows needs: those and the
  rows it writes past them (at most ``capacity``)."""
  return min(attend_len + scratch_rows, capacity)


def grows_caches(target: Target) -> bool:
  """Whether ``run_rounds`` starts the caches small and grows them: where
  attention is XLA's on one device (reading a prefix of a larger buffer is a
  copy there; the Pallas kernels skip unused rows themselves)."""
  return target.mesh is None and resolve_impl(target.attn_impl.partition(":")[0]) == "xla"


def attend_bucket(length: int, capacity: int) -> int:
  """Static cache window for a max committed ``length``: the next power of two.

  A round only reads this many cache rows, so the work follows the real length
  while the number of distinct compiled shapes stays logarithmic.
  """
  bucket = _MIN_ATTEND
  while bucket < length:
    bucket *= 2
  return min(bucket, capacity)


@dataclasses.dataclass
class GenerateStats:
  """Per-call statistics.

  rounds: decoding rounds after prefill (one target call each).
  new_tokens: tokens emitted, all sequences together.
  mean_accept_len: tokens emitted per sequence per round, bonus token included
    (1.0 for plain decoding).
  tokens_per_s: new tokens / decode time (prefill excluded).
  compile_s: seconds of the decode time spent tracing, lowering and compiling
    (shapes seen for the first time in this process); 0 once all are compiled.
    A cold call is slower than that by more (first dispatches), so compare warm
    calls for speed, as ``infer.bench`` and ``infer.main --compare`` do.
  time_to_first_token_s: prefill + first token.
  total_s: wall time of the whole call.
  phase_s: seconds per phase where the decoder measures them (profile mode).
  """

  rounds: int = 0
  new_tokens: int = 0
  mean_accept_len: float = 0.0
  tokens_per_s: float = 0.0
  compile_s: float = 0.0
  time_to_first_token_s: float = 0.0
  total_s: float = 0.0
  phase_s: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GenerateOutput:
  """tokens: new ids (list, or a list per prompt for batch input, EOS included when
  hit); text: decoded new text (str or list of str); stats: ``GenerateStats``."""

  tokens: Any
  text: Any
  stats: GenerateStats


def encode_prompts(target: Target, prompt, chat: bool = True) -> tuple[list[list[int]], bool]:
  """Turns a prompt argument into token-id lists.

  prompt: a string (chat template applied unless ``chat=False``), a list of ids,
  a list of chat messages ({"role", "content"} dicts), or a list of any of those
  (a batch). Returns (id lists, whether the input was a batch).
  """
  def one(p) -> list[int]:
    if isinstance(p, str):
      if target.tokenizer is None:
        raise InputError("this target has no tokenizer; pass token ids instead of text")
      if not p:
        raise InputError("empty prompt: pass at least one token or character")
      return list(target.tokenizer.encode_chat(p) if chat else target.tokenizer.encode(p))
    if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
      if target.tokenizer is None:
        raise InputError("this target has no tokenizer; chat messages need one")
      return list(target.tokenizer.encode_chat(list(p)))
    ids = [int(x) for x in np.asarray(p).reshape(-1)]
    if not ids:
      raise InputError("empty prompt: pass at least one token id")
    bad = [x for x in ids if not 0 <= x < target.config.vocab_size]
    if bad:
      raise InputError(f"token ids {bad[:5]} are outside the vocabulary "
                       f"[0, {target.config.vocab_size})")
    return ids

  is_single = (isinstance(prompt, str)
               or (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0
                   and not isinstance(prompt[0], str)
                   and (np.isscalar(prompt[0]) or isinstance(prompt[0], dict))))
  if is_single:
    return [one(prompt)], False
  if isinstance(prompt, (list, tuple)) and prompt:
    return [one(p) for p in prompt], True
  raise InputError(f"empty or unsupported prompt {prompt!r}: pass text, token ids, "
                   "chat messages, or a non-empty list of those")


def stop_token_ids(target: Target, eos_token_ids: Sequence[int] | None) -> frozenset[int]:
  if eos_token_ids is not None:
    return frozenset(int(e) for e in eos_token_ids)
  ids = set(target.config.eos_token_ids)
  if target.tokenizer is not None:
    ids |= set(target.tokenizer.eos_token_ids)
  return frozenset(ids)


def _check_generate_args(max_new_tokens: int) -> None:
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def run_rounds(target: Target, prompt_ids: list[list[int]], decoder: Decoder,
               max_new_tokens: int, stop_ids: frozenset[int],
               max_length: int | None = None) -> Iterator[tuple[list[list[int]], GenerateStats]]:
  """Drives a decoder; yields (new ids per sequence this round, running stats)."""
  _check_generate_args(max_new_tokens)
  max_len = max_length or target.config.max_position_embeddings
  longest = max(len(p) for p in prompt_ids)
  capacity = longest + max_new_tokens + decoder.scratch_rows
  if capacity > max_len:
    if longest + decoder.scratch_rows >= max_len:
      raise InputError(
          f"prompt of {longest} tokens does not fit the cache: max_length={max_len} "
          f"(needs room for the prompt, {decoder.scratch_rows} scratch rows and at least "
          "one new token); shorten the prompt or raise max_length")
  # Rounded up so that calls with similar lengths share compiled functions.
  capacity = min(-(-capacity // _CAPACITY_STEP) * _CAPACITY_STEP, max_len)
  batch = len(prompt_ids)
  padded_len = min(-(-longest // _PROMPT_PAD) * _PROMPT_PAD, capacity)
  tokens = np.zeros((batch, padded_len), np.int32)
  for i, p in enumerate(prompt_ids):
    tokens[i, :len(p)] = p
  prompt_lens = np.array([len(p) for p in prompt_ids], np.int32)

  stats = GenerateStats()
  t0 = time.perf_counter()
  grows = grows_caches(target)
  rows = capacity
  if grows:
    rows = max(padded_len, cache_rows(attend_bucket(longest + 1, capacity),
                                      decoder.scratch_rows, capacity))
  state, first = decoder.start(target.place_batch(tokens), target.place_batch(prompt_lens),
                               capacity, None, cache_rows=rows)
  first = np.asarray(first)
  stats.time_to_first_token_s = time.perf_counter() - t0
  emitted = [[] for _ in range(batch)]
  done = np.zeros(batch, bool)
  committed = prompt_lens.copy()  # tokens in the target cache (the root is not)

  def accept(row: int, new: Sequence[int]) -> list[int]:
    out = []
    for tok in new[:max_new_tokens - len(emitted[row])]:
      out.append(int(tok))
      if out[-1] in stop_ids:
        break
    emitted[row].extend(out)
    no_room = committed[row] + 1 + decoder.scratch_rows > capacity
    if (out and out[-1] in stop_ids) or len(emitted[row]) >= max_new_tokens or no_room:
      done[row] = True
    return out

  yield [accept(i, [first[i]]) for i in range(batch)], stats
  t_decode = time.perf_counter()
  row_rounds = accepted_total = 0
  # The batch row each of the state's sequences decodes (-1: a filler slot).
  slot_rows = np.arange(batch)
  can_drop = getattr(decoder, "keep_rows", None) is not None and target.mesh is None
  placed_active = None  # (active, that mask on the device)
  with CompileWatch() as watch:
    while not done.all():
      if can_drop:
        state, slot_rows = _drop_finished(decoder, state, slot_rows, done)
      active = (slot_rows >= 0) & ~done[np.maximum(slot_rows, 0)]
      attend_len = attend_bucket(int(committed[slot_rows[active]].max()) + 1, capacity)
      if grows and cache_rows(attend_len, decoder.scratch_rows, capacity) > rows:
        extra = cache_rows(attend_len, decoder.scratch_rows, capacity) - rows
        state, rows = grow_caches(state, extra), rows + extra
      if placed_active is None or not np.array_equal(active, placed_active[0]):
        placed_active = (active, target.place_batch(active))  # changes rarely
      state, new_tokens, num_new = decoder.step(state, placed_active[1], attend_len)
      new_tokens, num_new = np.asarray(new_tokens), np.asarray(num_new)
      stats.rounds += 1
      row_rounds += int(active.sum())
      chunk = [[] for _ in range(batch)]
      for slot in np.flatnonzero(active):
        i = slot_rows[slot]
        accepted_total += int(num_new[slot])
        committed[i] += int(num_new[slot])
        chunk[i] = accept(i, new_tokens[slot, :num_new[slot]].tolist())
      elapsed = time.perf_counter() - t_decode
      stats.new_tokens = sum(len(e) for e in emitted)
      stats.mean_accept_len = accepted_total / row_rounds
      stats.tokens_per_s = (stats.new_tokens - batch) / elapsed if elapsed > 0 else 0.0
      stats.compile_s = watch.decode_compile_s
      stats.total_s = time.perf_counter() - t0
      yield chunk, stats
  stats.new_tokens = sum(len(e) for e in emitted)
  stats.total_s = time.perf_counter() - t0
  stats.phase_s.update(getattr(decoder, "phase_s", {}))


def kept_batch_size(live: int, size: int) -> int:
  """The batch a decoder of ``size`` sequences, ``live`` of them unfinished,
  shrinks to: the next multiple of ``_KEPT_BATCH_STEP`` >= ``live`` once that
  is at most ``_KEPT_BATCH_SHRINK`` of ``size``, else ``size``.

  A round's cost grows with its rows (on the 2-core CPU a decode step of 32 to
  128 sequences is bound by arithmetic, ~2.3 ms per row), so finished sequences
  are dropped rather than carried. Halving only (powers of two) ran a batch of
  65-128 live rows at 128 until half had finished; answers of mixed lengths
  (regeneration, 128 prompts, many stopping early) then paid for ~25% idle
  rows. Each distinct size compiles once per attention window, so sizes come
  in steps of 8 and a batch shrinks only by a quarter or more (~3 sizes per
  call, reused by later calls).
  """
  kept = max(_KEPT_BATCH_STEP, -(-live // _KEPT_BATCH_STEP) * _KEPT_BATCH_STEP)
  return kept if kept <= _KEPT_BATCH_SHRINK * size else size


def _drop_finished(decoder: Decoder, state: Any, slot_rows: np.ndarray, done: np.ndarray
                   ) -> tuple[Any, np.ndarray]:
  """Shrinks the decoder's batch to its unfinished sequences (``kept_batch_size``);
  the free slots repeat a live sequence and are never active."""
  live = np.flatnonzero((slot_rows >= 0) & ~done[np.maximum(slot_rows, 0)])
  size = kept_batch_size(len(live), len(slot_rows))
  if size == len(slot_rows) or not len(live):
    return state, slot_rows
  filler = np.full(size - len(live), live[0])
  state = decoder.keep_rows(state, np.concatenate([live, filler]))
  return state, np.concatenate([slot_rows[live], np.full(len(filler), -1)])


def _decode_text(target: Target, ids: list[int]) -> str:
  return target.tokenizer.decode(ids) if target.tokenizer is not None else ""


def generate_stream(target: Target, prompt, *, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: int = 0, chat: bool = True, method=None, draft=None,
                    ngram=None, max_length: int | None = None,
                    eos_token_ids: Sequence[int] | None = None,
                    stats_out: dict | None = None,
                    **method_kwargs) -> Iterator[Any]:
  """Like ``generate`` but yields new text as rounds finish.

  Yields a str per round for a single prompt, a list of str (one per prompt) for a
  batch. Needs a tokenizer. If ``stats_out`` is a dict, ``stats_out["stats"]``
  holds the ``GenerateStats`` once the stream is exhausted.
  """
  if target.tokenizer is None:
    raise InputError("streaming text needs a tokenizer; use generate() with token ids")
  sampling = SamplingConfig(temperature, top_p, top_k)
  prompt_ids, is_batch = encode_prompts(target, prompt, chat)
  decoder = make_decoder(target, sampling, seed, draft, ngram, method=method,
                         **method_kwargs)
  stream = [target.tokenizer.stream_decoder() for _ in prompt_ids]
  for chunk, stats in run_rounds(target, prompt_ids, decoder, max_new_tokens,
                                 stop_token_ids(target, eos_token_ids), max_length):
    if stats_out is not None:
      stats_out["stats"] = stats
    texts = [s.feed(ids) for s, ids in zip(stream, chunk)]
    if is_batch:
      yield texts
    elif texts[0]:
      yield texts[0]
  tails = [s.flush() for s in stream]
  if is_batch and any(tails):
    yield tails
  elif not is_batch and tails[0]:
    yield tails[0]


def generate(target: Target, prompt, *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, chat: bool = True, method=None, draft=None, ngram=None,
             max_length: int | None = None,
             eos_token_ids: Sequence[int] | None = None,
             **method_kwargs) -> GenerateOutput:
  """Generates a continuation, plainly or with a speculative draft model.

  Args:
    target: a ``Target`` from ``load_target``.
    prompt: text (chat template applied unless ``chat=False``), token ids, chat
      messages, or a list of those (a batch; ragged lengths are fine).
    max_new_tokens: per sequence.
    temperature, top_p, top_k: target sampling (temperature 0 = greedy). Applied in
      that order; speculative decoding samples from exactly this distribution.
    seed: RNG seed.
    method: None for plain autoregressive decoding, or a speculative method:
      ``dj.DART(head, ngram, tree=TreeConfig(...))``, ``dj.DARTree(drafter,
      "dartree", DARTreeConfig(...))`` or ``dj.DartGru(drafter, ...)``
      (``dart_jax.decode.methods``).
    draft: the older form of ``method``: a draft model (a DART head from
      ``load_dart``, a DFlash / Domino / DART-GRU drafter); its options come as
      ``ngram=`` and ``**method_kwargs``. Give ``method`` or ``draft``, not both.
    ngram: N-gram table for DART's tree search (with ``draft=``).
    max_length: cache capacity (prompt + generation); default the model's
      ``max_position_embeddings``.
    eos_token_ids: stop tokens; default the model's and tokenizer's EOS ids; ``()``
      never stops early.
    **method_kwargs: ``profile=True`` times the round's phases (``stats.phase_s``);
      with ``draft=``, the method's options, e.g. for DART
      ``tree=TreeConfig(...)`` and ``context_ngram=True|False|ContextNGramConfig``
      (default on: the search also uses the sequence's own n-grams, see
      ``dart_jax.ngram.context``; False = the reference search); for DARTree
      ``tree="dartree"`` and ``tree_config=DARTreeConfig(...)`` or its fields.
  Returns:
    ``GenerateOutput`` with ``.tokens``, ``.text`` and ``.stats``.
  """
  sampling = SamplingConfig(temperature, top_p, top_k)
  prompt_ids, is_batch = encode_prompts(target, prompt, chat)
  decoder = make_decoder(target, sampling, seed, draft, ngram, method=method,
                         **method_kwargs)
  emitted = [[] for _ in prompt_ids]
  stats = GenerateStats()
  for chunk, stats in run_rounds(target, prompt_ids, decoder, max_new_tokens,
                                 stop_token_ids(target, eos_token_ids), max_length):
    for row, ids in zip(emitted, chunk):
      row.extend(ids)
  texts = [_decode_text(target, ids) for ids in emitted]
  if is_batch:
    return GenerateOutput(emitted, texts, stats)
  return GenerateOutput(emitted[0], texts[0], stats)
