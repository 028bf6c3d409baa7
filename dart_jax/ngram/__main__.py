"""Command line: build a reference-format `.trie` from text.

  python -m dart_jax.ngram build --tokenizer PATH --data FILES... --out X.trie

Like the reference builder, each document is encoded with special tokens
(BOS etc. as the tokenizer's post-processor adds them), an EOS id is appended,
and every document is counted on its own. Inputs: ``.jsonl``/``.json`` (one
JSON object per line; the text is ``--text-key`` or, for chat records, the
contents of ``messages``/``conversations`` joined by newlines), ``.txt`` (one
document per non-empty line, or the whole file with ``--txt-mode file``);
any of them may be gzipped (``.gz``).
"""

import argparse
import gzip
import json
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from dart_jax.errors import CheckpointError, DartJaxError, InputError
from dart_jax.ngram.model import NGram

_TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str):
  """`tokenizers.Tokenizer` from a tokenizer.json file or its directory."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  file = os.path.join(path, _TOKENIZER_FILE) if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise CheckpointError(
        f"Tokenizer not found: {file!r}. Pass a tokenizer.json file or a "
        "directory that contains one.")
  try:
    return tokenizers.Tokenizer.from_file(file)
  except Exception as e:  # The tokenizers error types are not public.
    raise CheckpointError(f"Cannot read tokenizer {file!r}: {e}") from e


def find_eos_id(tokenizer, path: str) -> int | None:
  """EOS id from tokenizer_config.json next to the tokenizer, if any."""
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  config_file = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(config_file):
    return None
  with open(config_file, encoding="utf-8") as f:
    eos = json.load(f).get("eos_token")
  if isinstance(eos, dict):
    eos = eos.get("content")
  return tokenizer.token_to_id(eos) if isinstance(eos, str) else None


def _open_text(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def _record_text(record, text_key: str, where: str) -> str:
  if isinstance(record, str):
    return record
  if isinstance(record, dict):
    if isinstance(record.get(text_key), str):
      return record[text_key]
    for key in ("messages", "conversations"):
      turns = record.get(key)
      if isinstance(turns, list):
        return "\n".join(
            str(t.get("content", t.get("value", ""))) if isinstance(t, dict)
            else str(t) for t in turns)
  raise InputError(f"{where}: no text found (expected a string, a {text_key!r} "
                   "field, or a messages/conversations list).")


def iter_documents(path: str, text_key: str = "text",
                   txt_mode: str = "line") -> Iterator[str]:
  """Documents of one input file."""
  if not os.path.isfile(path):
    raise InputError(f"Data file not found: {path!r}.")
  name = path[:-3] if path.endswith(".gz") else path
  with _open_text(path) as f:
    if name.endswith((".jsonl", ".json")):
      for number, line in enumerate(f, start=1):
        line = line.strip()
        if not line:
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise InputError(f"{path}:{number}: invalid JSON ({e}). Use one JSON "
                           "object per line.") from e
        yield _record_text(record, text_key, f"{path}:{number}")
    elif txt_mode == "file":
      yield f.read()
    else:
      for line in f:
        if line.strip():
          yield line.rstrip("\n")


def build_from_files(tokenizer, files: Sequence[str], order: int = 3,
                     eos_id: int | None = None, text_key: str = "text",
                     txt_mode: str = "line", add_special_tokens: bool = True,
                     batch_size: int = 512, progress: bool = True) -> NGram:
  """Tokenizes every document of `files` and counts its n-grams."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  chunks, lengths = [], []
  bar = tqdm(desc="documents", unit="doc", disable=not progress)
  num_tokens = 0

  def flush(batch):
    nonlocal num_tokens
    for encoding in tokenizer.encode_batch(batch,
                                           add_special_tokens=add_special_tokens):
      ids = encoding.ids + ([eos_id] if eos_id is not None else [])
      chunks.append(np.asarray(ids, np.int32))
      lengths.append(len(ids))
      num_tokens += len(ids)
    bar.update(len(batch))
    bar.set_postfix(tokens=num_tokens)

  for path in files:
    batch = []
    for text in iter_documents(path, text_key, txt_mode):
      batch.append(text)
      if len(batch) >= batch_size:
        flush(batch)
        batch = []
    if batch:
      flush(batch)
  bar.close()
  tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
  return NGram.from_arrays(tokens, np.asarray(lengths, np.int64), order)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m dart_jax.ngram",
                                   description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  build = commands.add_parser("build", help="Build a .trie from text files.")
  build.add_argument("--tokenizer", required=True,
                     help="tokenizer.json or a directory containing it")
  build.add_argument("--data", required=True, nargs="+",
                     help=".jsonl/.json/.txt files (optionally .gz)")
  build.add_argument("--out", required=True, help="output .trie path")
  build.add_argument("--order", type=int, default=3)
  build.add_argument("--eos-id", type=int, default=None,
                     help="EOS id appended to each document (default: the "
                     "eos_token of tokenizer_config.json, if present)")
  build.add_argument("--no-eos", action="store_true",
                     help="do not append an EOS id")
  build.add_argument("--no-special-tokens", action="store_true",
                     help="encode without the tokenizer's special tokens")
  build.add_argument("--text-key", default="text")
  build.add_argument("--txt-mode", choices=("line", "file"), default="line")
  build.add_argument("--reduce", type=int, default=None, metavar="THRESHOLD",
                     help="prune n-grams with count < THRESHOLD before saving")
  build.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)

  start = time.perf_counter()
  tokenizer = load_tokenizer(args.tokenizer)
  eos_id = None if args.no_eos else (
      args.eos_id if args.eos_id is not None
      else find_eos_id(tokenizer, args.tokenizer))
  if eos_id is None and not args.no_eos:
    print("warning: no EOS id found (pass --eos-id); documents are counted "
          "without one.", file=sys.stderr)
  ngram = build_from_files(
      tokenizer, args.data, order=args.order, eos_id=eos_id,
      text_key=args.text_key, txt_mode=args.txt_mode,
      add_special_tokens=not args.no_special_tokens, progress=not args.quiet)
  num_tokens = int(ngram.arrays.counts[0])
  if args.reduce is not None:
    ngram = ngram.reduce(args.reduce)
  ngram.save_trie(args.out)
  if not args.quiet:
    print(f"wrote {args.out}: order {ngram.order}, {num_tokens} tokens, "
          f"{ngram.num_nodes} nodes, {time.perf_counter() - start:.1f}s")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except DartJaxError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
