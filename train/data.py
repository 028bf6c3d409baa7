"""Training data for DART heads: chat JSONL -> packed token rows -> batches.

Formats (one JSON object per line):
  ShareGPT:  {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
  OpenAI:    {"messages": [{"role": "user"|"assistant"|"system", "content": "..."}]}
  plain:     {"text": "..."}   (every token is a training target)
A file ending in ``.xz`` or ``.gz`` is read compressed (the bundled v2 data).

Chats are rendered with the target's chat template and tokenized once; a
token is a training target (``loss_mask``) when it belongs to an assistant
turn, end-of-turn token included. Malformed lines are counted and skipped with a
warning. Conversations are packed into rows of ``max_len`` tokens with segment
ids (attention never crosses segments), shuffled deterministically and cut into
global batches; each process takes its slice. The iterator's whole state is one
integer, saved with the checkpoints.

Command line:
  python -m train.data regenerate --model PATH --data IN.jsonl --out OUT.jsonl \
      [--max-new-tokens 512 --batch-size 16 --temperature 0.0 ...]
  python -m train.data stats --model PATH --data IN.jsonl [--max-len 1024]
"""

import argparse
import collections
import dataclasses
import hashlib
import gzip
import json
import logging
import lzma
import os
import sys
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from dart_jax.errors import CheckpointError, InputError
from dart_jax.models import precision

log = logging.getLogger(__name__)

_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "system": "system",
}
_OPENAI_ROLES = ("system", "user", "assistant")
_MAX_REPORTED_LINES = 5


@dataclasses.dataclass
class Example:
  """One tokenized record. tokens: [n] int32; loss_mask: [n] bool (token is a target)."""

  tokens: np.ndarray
  loss_mask: np.ndarray


@dataclasses.dataclass
class DataStats:
  """Counts collected while reading and tokenizing."""

  records: int = 0
  malformed: int = 0
  malformed_lines: list = dataclasses.field(default_factory=list)
  truncated: int = 0
  assistant_turns_not_found: int = 0
  tokens: int = 0
  target_tokens: int = 0

  def merge(self, other: "DataStats") -> None:
    for f in dataclasses.fields(self):
      value = getattr(other, f.name)
      if isinstance(value, list):
        getattr(self, f.name).extend(value)
      else:
        setattr(self, f.name, getattr(self, f.name) + value)


@dataclasses.dataclass
class Rows:
  """Packed fixed-length rows.

  tokens: [N, T] int32 (0 in padding); loss_mask: [N, T] bool; segment_ids:
  [N, T] int32 (1.. per packed record, 0 = padding); positions: [N, T] int32
  (position inside the record).
  """

  tokens: np.ndarray
  loss_mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    return {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)}

  def save(self, path: str) -> None:
    np.savez(path, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

  @classmethod
  def load(cls, path: str) -> "Rows":
    with np.load(path) as z:
      return cls(**{f.name: z[f.name] for f in dataclasses.fields(cls)})


# ------------------------------------------------------------------ reading


def read_jsonl(path: str, stats: DataStats) -> Iterator[tuple[int, Any]]:
  """Yields (line number, parsed record); malformed lines are counted in ``stats``."""
  if not os.path.isfile(path):
    raise InputError(f"data file not found: {path!r}")
  with _open_text(path) as f:
    lines = enumerate(f, 1)
    while True:
      try:
        line_no, line = next(lines)
      except StopIteration:
        return
      except (lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
        raise InputError(f"{path!r} is not a complete compressed file ({e}); "
                         "decompress it by hand to see how far it reads") from e
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        _bad(stats, path, line_no)
        continue
      yield line_no, record


def _open_text(path: str):
  """Opens a (possibly ``.xz`` / ``.gz`` compressed) text file for reading."""
  opener = {".xz": lzma.open, ".gz": gzip.open}.get(os.path.splitext(path)[1], open)
  return opener(path, "rt", encoding="utf-8", errors="replace")


def _bad(stats: DataStats, path: str, line_no: int) -> None:
  stats.malformed += 1
  if len(stats.malformed_lines) < _MAX_REPORTED_LINES:
    stats.malformed_lines.append(f"{path}:{line_no}")


def record_to_messages(record: Any) -> list[dict] | str:
  """A ShareGPT / OpenAI record -> messages; a ``text`` record -> its string.

  Raises InputError when the record has none of those shapes.
  """
  if not isinstance(record, dict):
    raise InputError("record is not a JSON object")
  if "conversations" in record:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
      raise InputError("'conversations' must be a non-empty list")
    messages = []
    for turn in turns:
      if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise InputError("each ShareGPT turn needs a string 'value'")
      role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
      if role is None:
        raise InputError(f"unknown ShareGPT speaker {turn.get('from')!r}")
      messages.append({"role": role, "content": turn["value"]})
    return messages
  if "messages" in record:
    turns = record["messages"]
    if not isinstance(turns, list) or not turns:
      raise InputError("'messages' must be a non-empty list")
    messages = []
    for turn in turns:
      if (not isinstance(turn, dict) or turn.get("role") not in _OPENAI_ROLES
          or not isinstance(turn.get("content"), str)):
        raise InputError("each message needs a role (system/user/assistant) and "
                         "string content")
      messages.append({"role": turn["role"], "content": turn["content"]})
    return messages
  if isinstance(record.get("text"), str) and record["text"]:
    return record["text"]
  raise InputError("record has no 'conversations', 'messages' or 'text'")


def read_records(paths: Sequence[str], stats: DataStats,
                 max_examples: int = 0) -> list[list[dict] | str]:
  """All well-formed records of ``paths`` (messages or text), in file order."""
  out = []
  for path in paths:
    for line_no, record in read_jsonl(path, stats):
      try:
        out.append(record_to_messages(record))
      except InputError:
        _bad(stats, path, line_no)
        continue
      stats.records += 1
      if max_examples and len(out) >= max_examples:
        return out
  return out


def warn_malformed(stats: DataStats) -> None:
  if stats.malformed:
    log.warning("skipped %d malformed JSONL line(s) (e.g. %s); expected ShareGPT "
                "'conversations', OpenAI 'messages' or 'text' records",
                stats.malformed, ", ".join(stats.malformed_lines))


# --------------------------------------------------------------- tokenizing


def _eos_strings(tokenizer) -> list[str]:
  out = []
  for i in tokenizer.eos_token_ids:
    token = tokenizer.id_to_token(i)
    if token:
      out.append(token)
  return out


def tokenize_chat(tokenizer, messages: list[dict], stats: DataStats | None = None) -> Example:
  """Chat template -> (tokens, loss mask on assistant turns).

  The full conversation is rendered once and tokenized with character offsets
  (tokenizing turn by turn could split differently at the boundaries). Each
  assistant turn's content is located in the rendered text; its tokens plus an
  end-of-turn token directly after it are targets.
  """
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
  encoding = tokenizer.backend.encode(text, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int32)
  starts = np.asarray([s for s, _ in encoding.offsets], np.int64)
  mask = np.zeros(len(ids), bool)
  eos_strings = _eos_strings(tokenizer)
  cursor = 0
  for message in messages:
    content = message["content"].strip()
    if message["role"] != "assistant":
      # Skip past user/system content so an assistant answer that repeats it
      # is not matched there.
      found = text.find(content, cursor) if content else -1
      if found >= 0:
        cursor = found + len(content)
      continue
    if not content:
      continue
    begin = text.find(content, cursor)
    if begin < 0:
      if stats is not None:
        stats.assistant_turns_not_found += 1
      continue
    end = begin + len(content)
    for eos in eos_strings:
      if text.startswith(eos, end):
        end += len(eos)
        break
    mask |= (starts >= begin) & (starts < end)
    cursor = end
  return Example(ids, mask)


def tokenize_text(tokenizer, text: str) -> Example:
  """Plain text: every token is a target."""
  ids = np.asarray(tokenizer.encode(text), np.int32)
  return Example(ids, np.ones(len(ids), bool))


def tokenize_records(tokenizer, records: Iterable[list[dict] | str],
                     stats: DataStats) -> list[Example]:
  out = []
  for record in records:
    example = (tokenize_text(tokenizer, record) if isinstance(record, str)
               else tokenize_chat(tokenizer, record, stats))
    stats.tokens += len(example.tokens)
    stats.target_tokens += int(example.loss_mask.sum())
    out.append(example)
  return out


# ------------------------------------------------------------------ packing


def pack_examples(examples: Sequence[Example], max_len: int, pack: bool = True,
                  stats: DataStats | None = None) -> Rows:
  """Packs examples into [N, max_len] rows (next-fit, in order).

  Examples longer than ``max_len`` are truncated; examples with no target token
  after truncation are dropped. With ``pack=False`` each example gets its own row.
  """
  rows: list[list[Example]] = []
  used = max_len  # forces a new row first
  for ex in examples:
    if len(ex.tokens) > max_len:
      ex = Example(ex.tokens[:max_len], ex.loss_mask[:max_len])
      if stats is not None:
        stats.truncated += 1
    if len(ex.tokens) < 2 or not ex.loss_mask[1:].any():
      continue
    if pack and used + len(ex.tokens) <= max_len:
      rows[-1].append(ex)
      used += len(ex.tokens)
    else:
      rows.append([ex])
      used = len(ex.tokens)
  n = len(rows)
  tokens = np.zeros((n, max_len), np.int32)
  loss_mask = np.zeros((n, max_len), bool)
  segment_ids = np.zeros((n, max_len), np.int32)
  positions = np.zeros((n, max_len), np.int32)
  for r, members in enumerate(rows):
    offset = 0
    for s, ex in enumerate(members, 1):
      k = len(ex.tokens)
      tokens[r, offset:offset + k] = ex.tokens
      # The first token of a segment has no context inside the segment.
      loss_mask[r, offset + 1:offset + k] = ex.loss_mask[1:]
      segment_ids[r, offset:offset + k] = s
      positions[r, offset:offset + k] = np.arange(k)
      offset += k
  return Rows(tokens, loss_mask, segment_ids, positions)


# --------------------------------------------------------- draft vocabulary


def select_draft_vocab(rows: Rows, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
  """The ``draft_vocab_size`` most frequent target tokens, sorted by id.

  Frequencies count training-target tokens (assistant tokens); ties go to the
  smaller id. If the data has fewer distinct target tokens, the rest is filled
  with the most frequent other tokens of the rows, then the smallest unused ids.
  Returns used ids [Vd] (``DartHead.with_draft_vocab`` turns them into d2t/t2d).
  """
  if draft_vocab_size > vocab_size:
    raise InputError(f"draft_vocab_size={draft_vocab_size} > vocab_size={vocab_size}")
  valid = rows.segment_ids > 0
  targets = np.bincount(rows.tokens[rows.loss_mask], minlength=vocab_size)[:vocab_size]
  others = np.bincount(rows.tokens[valid], minlength=vocab_size)[:vocab_size]
  ids = np.arange(vocab_size)
  # Sort keys: target count desc, other count desc, id asc.
  order = np.lexsort((ids, -others, -targets))
  return np.sort(order[:draft_vocab_size])


# ---------------------------------------------------------------- iteration


class BatchIterator:
  """Deterministic shuffled batches over packed rows, sharded by process.

  The row stream is the concatenation of per-epoch permutations (seeded by
  ``seed`` and the epoch); global batch i is stream[i*B:(i+1)*B] and process p
  takes its contiguous slice of it. The full state is ``{"batches": i}`` plus
  checks, so resuming is exact.
  """

  def __init__(self, rows: Rows, global_batch: int, seed: int, *, shuffle: bool = True,
               process_index: int = 0, process_count: int = 1):
    if len(rows) == 0:
      raise InputError("no training rows: every example was empty or had no target tokens")
    if global_batch % process_count:
      raise InputError(f"batch_size={global_batch} is not divisible by the "
                       f"{process_count} processes")
    self.rows = rows
    self.global_batch = global_batch
    self.seed = seed
    self.shuffle = shuffle
    self.local_batch = global_batch // process_count
    self.process_index = process_index
    self.batches = 0
    self._perm_cache: dict[int, np.ndarray] = {}

  def _perm(self, epoch: int) -> np.ndarray:
    if epoch not in self._perm_cache:
      n = len(self.rows)
      perm = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
              else np.arange(n))
      self._perm_cache = {epoch: perm}
      return perm
    return self._perm_cache[epoch]

  def indices(self, batch: int) -> np.ndarray:
    """Row indices of this process's part of global batch ``batch``."""
    n = len(self.rows)
    start = batch * self.global_batch + self.process_index * self.local_batch
    stream = np.arange(start, start + self.local_batch)
    return np.asarray([self._perm(int(s // n))[s % n] for s in stream], np.int64)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    out = self.rows.take(self.indices(self.batches))
    self.batches += 1
    return out

  def get_state(self) -> dict:
    return {"batches": self.batches, "seed": self.seed, "num_rows": len(self.rows),
            "global_batch": self.global_batch}

  def set_state(self, state: dict) -> None:
    mine = self.get_state()
    for key in ("seed", "num_rows", "global_batch"):
      if state.get(key) != mine[key]:
        raise CheckpointError(
            f"the checkpoint's data iterator has {key}={state.get(key)} but this run has "
            f"{mine[key]}; resume with the same data, batch_size and data.shuffle_seed")
    self.batches = int(state["batches"])


def eval_batches(rows: Rows, batch: int, max_batches: int) -> list[dict[str, np.ndarray]]:
  """Fixed evaluation batches (in order; the last one padded with empty rows)."""
  out = []
  for start in range(0, len(rows), batch):
    if len(out) >= max_batches:
      break
    index = np.arange(start, min(start + batch, len(rows)))
    out.append(pad_batch(rows.take(index), batch))
  return out


def pad_batch(part: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
  """Pads a short batch with empty rows up to ``batch`` (one compiled shape)."""
  missing = batch - len(next(iter(part.values())))
  if missing <= 0:
    return part
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
          for k, v in part.items()}


# ------------------------------------------------------------------ prepare


@dataclasses.dataclass
class PreparedData:
  train: Rows
  eval: Rows | None
  stats: DataStats


def _cache_key(data_config, tokenizer) -> str:
  def file_id(path):
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]

  key = {
      "train": [file_id(p) for p in data_config.train],
      "eval": [file_id(p) for p in data_config.eval],
      "max_len": data_config.max_len, "pack": data_config.pack,
      "max_examples": data_config.max_examples,
      "eval_fraction": data_config.eval_fraction, "seed": data_config.shuffle_seed,
      "vocab": tokenizer.vocab_size, "eos": list(tokenizer.eos_token_ids),
      "template": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
      "version": 1,
  }
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare_data(data_config, tokenizer, cache_dir: str | None = None,
                 write_cache: bool = True) -> PreparedData:
  """Reads, tokenizes, splits and packs the data of a ``DataSection``.

  Raises InputError for missing files, data without any well-formed record, or
  data without any assistant (target) token.
  """
  if tokenizer is None:
    raise InputError("the target has no tokenizer; training data needs one "
                     "(a HF directory with tokenizer.json or a GGUF file)")
  for path in tuple(data_config.train) + tuple(data_config.eval):
    if not os.path.isfile(path):
      raise InputError(f"data file not found: {path!r}")
  if not data_config.train:
    raise InputError("data.train is empty: pass JSONL files, e.g. data.train=a.jsonl,b.jsonl")
  cache_base = None
  if cache_dir is not None:
    cache_base = os.path.join(cache_dir, _cache_key(data_config, tokenizer))
    if os.path.exists(cache_base + ".json"):
      with open(cache_base + ".json") as f:
        stats = DataStats(**json.load(f))
      train = Rows.load(cache_base + ".train.npz")
      ev = Rows.load(cache_base + ".eval.npz") if os.path.exists(cache_base + ".eval.npz") else None
      log.info("loaded tokenized data from %s", cache_base)
      return PreparedData(train, ev, stats)

  stats = DataStats()
  records = read_records(data_config.train, stats, data_config.max_examples)
  eval_records = read_records(data_config.eval, stats) if data_config.eval else []
  warn_malformed(stats)
  if not records:
    raise InputError(f"no well-formed records in {list(data_config.train)} "
                     f"({stats.malformed} malformed lines)")
  if not data_config.eval and data_config.eval_fraction > 0 and len(records) > 1:
    order = np.random.default_rng(data_config.shuffle_seed + 7919).permutation(len(records))
    n_eval = max(1, int(round(len(records) * data_config.eval_fraction)))
    held = set(order[:n_eval].tolist())
    eval_records = [r for i, r in enumerate(records) if i in held]
    records = [r for i, r in enumerate(records) if i not in held]
  examples = tokenize_records(tokenizer, records, stats)
  if not any(ex.loss_mask.any() for ex in examples):
    raise InputError(
        f"no assistant tokens in {list(data_config.train)}: the loss needs assistant "
        "turns (OpenAI role 'assistant' / ShareGPT from 'gpt') or plain 'text' records"
        + (f"; {stats.assistant_turns_not_found} assistant turn(s) were not found in "
           "the chat-template output" if stats.assistant_turns_not_found else ""))
  eval_stats = DataStats()
  eval_examples = tokenize_records(tokenizer, eval_records, eval_stats)
  train = pack_examples(examples, data_config.max_len, data_config.pack, stats)
  ev = pack_examples(eval_examples, data_config.max_len, data_config.pack) if eval_examples else None
  if ev is not None and len(ev) == 0:
    ev = None
  if cache_base is not None and write_cache:
    os.makedirs(cache_dir, exist_ok=True)
    train.save(cache_base + ".train.npz")
    if ev is not None:
      ev.save(cache_base + ".eval.npz")
    with open(cache_base + ".json.tmp", "w") as f:
      json.dump(dataclasses.asdict(stats), f)
    os.replace(cache_base + ".json.tmp", cache_base + ".json")  # written last: marks complete
  return PreparedData(train, ev, stats)


# ------------------------------------------------------------- regeneration


def _split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
  """-> (leading system messages, [user turns, each a list of non-assistant messages])."""
  head, turns = [], []
  for m in messages:
    if m["role"] == "assistant":
      continue
    if m["role"] == "system" and not turns:
      head.append(m)
    elif m["role"] == "user" or not turns:
      turns.append([m])
    else:
      turns[-1].append(m)
  return head, turns


def _complete_lines(out_path: str) -> list[dict]:
  """Complete output lines; a partial last line (killed mid-write) is cut off."""
  if not os.path.exists(out_path):
    return []
  with open(out_path, "rb") as f:
    data = f.read()
  cut = data.rfind(b"\n") + 1
  if cut != len(data):
    with open(out_path, "r+b") as f:
      f.truncate(cut)
  # Split on "\n" only: str.splitlines also breaks at U+2028 / U+0085, which JSON
  # strings may hold raw (answers are written with ensure_ascii=False).
  return [json.loads(line) for line in data[:cut].decode("utf-8").split("\n")
          if line.strip()]


def regenerate(target, data_paths: Sequence[str], out_path: str, *, max_new_tokens: int = 512,
               batch_size: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, max_prompt_tokens: int = 2048,
               max_batches: int = 0, group_by_length: bool = False,
               first_batch: int = 0, last_batch: int = 0,
               progress: bool = True) -> dict:
  """Replaces the assistant turns of chat data with the target's own answers.

  Conversations are answered turn by turn (each answer conditions on the
  regenerated earlier answers), ``batch_size`` conversations at a time with
  ``dart_jax.generate``. Each output line is ``{"messages": [...], "index": i,
  "batch": j}``. A rerun with the same arguments resumes after the last complete
  batch in ``out_path``; batch j always samples with seed ``seed + j``, so a
  resumed file equals an uninterrupted one.

  ``group_by_length`` batches conversations with the same number of user
  turns and similar first-prompt lengths (a stable sort on both): a batch's
  follow-up rounds then run with every row, and prefill pads little. The order
  is a pure function of the input, so resuming still works.

  ``first_batch`` / ``last_batch`` (0 = to the end) answer one slice of that
  batch plan, so two runs over one prompt file can answer disjoint prompts
  (e.g. greedy for batches [0, 60), sampled for [60, 76)). ``max_batches``
  only caps this run; a rerun goes on.

  Returns counts: written, skipped (text records, no user turn), unanswered
  (written without an answer: first prompt too long), malformed.
  """
  import dart_jax as dj
  from tqdm import tqdm

  if target.tokenizer is None or not target.tokenizer.chat_template:
    raise InputError("regeneration needs a target with a tokenizer and a chat template")
  stats = DataStats()
  records = read_records(data_paths, stats)
  warn_malformed(stats)
  convs = [(i, r) for i, r in enumerate(records) if not isinstance(r, str)]
  valid = [(i, _split_turns(m)) for i, m in convs if _split_turns(m)[1]]
  if group_by_length:
    valid.sort(key=lambda item: (len(item[1][1]), len(target.tokenizer.encode_chat(
        item[1][0] + item[1][1][0]))))
  skipped = len(records) - len(valid)
  batches = [valid[j:j + batch_size] for j in range(0, len(valid), batch_size)]
  stop = len(batches) if not last_batch else min(len(batches), last_batch)
  if not 0 <= first_batch < stop:
    raise InputError(f"batch range [{first_batch}, {last_batch or len(batches)}) is empty; "
                     f"the data makes {len(batches)} batches of {batch_size}")

  done = _complete_lines(out_path)
  by_batch = collections.Counter(line["batch"] for line in done)
  start = first_batch
  while start < stop and by_batch.get(start, 0) == len(batches[start]):
    start += 1
  if start < stop and by_batch.get(start, 0):
    # The last batch was cut short: drop its lines and redo it.
    keep = [line for line in done if line["batch"] < start]
    with open(out_path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in keep)
  written = sum(len(b) for b in batches[first_batch:start])
  unanswered = 0
  end = stop if not max_batches else min(stop, start + max_batches)
  bar = tqdm(total=sum(len(b) for b in batches[first_batch:stop]), initial=written,
             unit="conv", disable=not progress, desc="regenerate")
  tokenizer = target.tokenizer
  new_tokens, generate_s = 0, 0.0  # This run's, for the tokens/s on the bar.
  for j in range(start, end):
    batch = batches[j]
    histories = [list(head) for _, (head, _) in batch]
    active = [True] * len(batch)
    num_rounds = max(len(turns) for _, (_, turns) in batch)
    for r in range(num_rounds):
      rows = []
      for b, (_, (_, turns)) in enumerate(batch):
        if not active[b] or r >= len(turns):
          continue
        candidate = histories[b] + turns[r]
        if len(tokenizer.encode_chat(candidate)) > max_prompt_tokens:
          active[b] = False  # Keep the turns answered so far.
          continue
        histories[b] = candidate
        rows.append(b)
      if not rows:
        break
      out = dj.generate(target, [histories[b] for b in rows], max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed + j * 1009 + r)
      for b, text in zip(rows, out.text):
        histories[b].append({"role": "assistant", "content": text})
      new_tokens += out.stats.new_tokens
      generate_s += out.stats.total_s
      bar.set_postfix(tok_s=f"{new_tokens / max(generate_s, 1e-9):.0f}")
    lines = []
    for (index, _), history in zip(batch, histories):
      if not any(m["role"] == "assistant" for m in history):
        unanswered += 1
      lines.append(json.dumps({"messages": history, "index": index, "batch": j},
                              ensure_ascii=False) + "\n")
    with open(out_path, "a", encoding="utf-8") as f:
      f.write("".join(lines))
      f.flush()
      os.fsync(f.fileno())
    written += len(batch)
    bar.update(len(batch))
  bar.close()
  return {"written": written, "skipped": skipped, "unanswered": unanswered,
          "malformed": stats.malformed,
          "batches_done": end, "batches_total": len(batches),
          "new_tokens": new_tokens, "generate_s": round(generate_s, 3),
          "tokens_per_s": round(new_tokens / generate_s, 1) if generate_s else 0.0}


# --------------------------------------------------------------------- CLI


def _build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.data",
                              description="Data tools for DART head training.")
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("regenerate", help="replace assistant turns with the target's answers")
  r.add_argument("--model", default=None,
                 help="target: HF dir or .gguf (default: embedded SmolLM2-135M)")
  r.add_argument("--data", required=True, nargs="+", help="input JSONL file(s)")
  r.add_argument("--out", required=True, help="output JSONL (resumed if it exists)")
  r.add_argument("--max-new-tokens", type=int, default=512)
  r.add_argument("--batch-size", type=int, default=16)
  r.add_argument("--temperature", type=float, default=0.0)
  r.add_argument("--top-p", type=float, default=1.0)
  r.add_argument("--top-k", type=int, default=0)
  r.add_argument("--seed", type=int, default=0)
  r.add_argument("--max-prompt-tokens", type=int, default=2048)
  r.add_argument("--max-batches", type=int, default=0,
                 help="stop this run after N batches (0 = all); a rerun goes on")
  r.add_argument("--first-batch", type=int, default=0,
                 help="answer the batch plan from batch N on (to give runs disjoint prompts)")
  r.add_argument("--last-batch", type=int, default=0,
                 help="stop before batch N of the plan (0 = the end)")
  r.add_argument("--group-by-length", action="store_true",
                 help="batch conversations of equal turn count and similar prompt length")
  precision.add_cli_flag(r)
  s = sub.add_parser("stats", help="tokenize and print data statistics")
  s.add_argument("--model", default=None)
  s.add_argument("--data", required=True, nargs="+")
  s.add_argument("--max-len", type=int, default=1024)
  precision.add_cli_flag(s)
  return p


def main(argv=None) -> int:
  import dart_jax as dj

  args = _build_parser().parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
  try:
    target = dj.load_target(args.model, dtype=precision.resolve_flag(args.precision))
    if args.command == "regenerate":
      result = regenerate(target, args.data, args.out, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          max_prompt_tokens=args.max_prompt_tokens,
                          max_batches=args.max_batches,
                          group_by_length=args.group_by_length,
                          first_batch=args.first_batch, last_batch=args.last_batch)
      print(json.dumps(result))
    else:
      stats = DataStats()
      records = read_records(args.data, stats)
      warn_malformed(stats)
      examples = tokenize_records(target.tokenizer, records, stats)
      rows = pack_examples(examples, args.max_len, True, stats)
      print(json.dumps({**dataclasses.asdict(stats), "rows": len(rows),
                        "fill": float((rows.segment_ids > 0).mean()) if len(rows) else 0.0}))
  except dj.DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
