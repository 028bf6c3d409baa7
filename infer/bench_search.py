"""Benchmark: DART tree search per round, jitted vs the numpy reference.

  python -m infer.bench_search [--levels 8] [--vocab 49152] [--trie X.trie]

Defaults are the reference settings: D+1 = 8 levels, topk 25, beam 20,
remain_total 60, draft vocab 49152, an order-3 N-gram. Without --trie the
N-gram is built from synthetic Zipf-distributed token data (--tokens many).
Timings alternate jitted and reference calls in one process and report the
median and minimum (CPU timings vary run to run on shared machines). Also
prints n-gram build throughput and table memory per stored n-gram.
"""

import argparse
import os
import tempfile
import time

import jax
import numpy as np

from dart_jax.ngram import NGram
from dart_jax.tree import TreeConfig, dart_search, level_candidates
from dart_jax.tree.dart_search import search_candidates
from dart_jax.tree.reference import reference_search


def _time(fn, repeats: int) -> np.ndarray:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return np.array(times) * 1e3


def _describe(name: str, ms: np.ndarray) -> str:
  return (f"{name:<34s} median {np.median(ms):8.3f} ms   min {ms.min():8.3f} ms"
          f"   ({ms.size} runs)")


def synthetic_corpus(rng, num_tokens: int, vocab: int) -> list[np.ndarray]:
  """Zipf-distributed token ids in documents of 200-2000 tokens."""
  docs, total = [], 0
  while total < num_tokens:
    length = int(rng.integers(200, 2000))
    docs.append(np.minimum(rng.zipf(1.2, size=length) - 1, vocab - 1))
    total += length
  return docs


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--levels", type=int, default=8, help="D+1")
  parser.add_argument("--vocab", type=int, default=49152)
  parser.add_argument("--topk", type=int, default=25)
  parser.add_argument("--beam", type=int, default=20)
  parser.add_argument("--remain-total", type=int, default=60)
  parser.add_argument("--tokens", type=int, default=2_000_000,
                      help="synthetic n-gram training tokens")
  parser.add_argument("--trie", default=None, help="use this .trie instead")
  parser.add_argument("--repeats", type=int, default=200)
  parser.add_argument("--reference-repeats", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(args.seed)

  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; levels "
        f"{args.levels}, topk {args.topk}, beam {args.beam}, remain_total "
        f"{args.remain_total}, vocab {args.vocab}")
  if args.trie:
    start = time.perf_counter()
    ngram = NGram.load_trie(args.trie)
    print(f"loaded {args.trie}: {ngram.num_nodes} nodes in "
          f"{time.perf_counter() - start:.1f}s")
  else:
    docs = synthetic_corpus(rng, args.tokens, args.vocab)
    num_tokens = sum(d.shape[0] for d in docs)
    start = time.perf_counter()
    ngram = NGram.build(docs, order=3)
    seconds = time.perf_counter() - start
    print(f"NGram.build: {num_tokens} tokens -> {ngram.num_nodes} nodes in "
          f"{seconds:.2f}s = {num_tokens / seconds * 60 / 1e6:.1f}M tokens/min")
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "bench.trie")
    start = time.perf_counter()
    ngram.save_trie(path)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    NGram.load_trie(path)
    print(f"save_trie {saved:.2f}s, load_trie {time.perf_counter() - start:.2f}s"
          f" ({os.path.getsize(path) / 2**20:.0f} MiB file)")
  start = time.perf_counter()
  table = ngram.to_table()
  print(f"to_table: {time.perf_counter() - start:.2f}s, {table.nbytes / 2**20:.1f}"
        f" MiB = {table.bytes_per_ngram:.1f} bytes per stored n-gram (lookup "
        f"windows {table.window}); the reference C++ trie holds ~"
        f"{ngram.reference_memory_bytes() / (ngram.num_nodes - 1):.0f} "
        f"bytes per n-gram in RAM, its .trie file 36")

  config = TreeConfig(topk=args.topk, beam_width=args.beam,
                      remain_total=args.remain_total)
  # Draft logits with a realistic shape: a few strong candidates per level.
  logits = rng.standard_normal((args.levels, args.vocab)).astype(np.float32)
  logits[:, :2000] += rng.uniform(0, 6, size=(args.levels, 2000))
  context = np.minimum(rng.zipf(1.2, size=64) - 1, args.vocab - 1).astype(
      np.int32)
  logits_dev, context_dev = jax.device_put(logits), jax.device_put(context)

  search = jax.jit(dart_search, static_argnames=("config",))
  candidates = jax.jit(level_candidates, static_argnums=1)
  search_only = jax.jit(search_candidates, static_argnames=("config",))
  start = time.perf_counter()
  jax.block_until_ready(search(logits_dev, context_dev, table, config=config))
  print(f"compile + first call: {time.perf_counter() - start:.1f}s")
  tokens, log_probs = candidates(logits_dev, config)
  jax.block_until_ready(search_only(tokens, log_probs, context_dev, table,
                                    config=config))
  jax.block_until_ready(search_only(tokens, log_probs, context_dev, None,
                                    config=config))

  jit_ms, ref_ms = [], []
  for i in range(args.repeats):
    jit_ms.append(_time(lambda: search(logits_dev, context_dev, table,
                                       config=config), 1)[0])
    if i < args.reference_repeats:
      ref_ms.append(_time(lambda: reference_search(logits, context, ngram,
                                                   config), 1)[0])
  print(_describe("dart_search (jit, whole round)", np.array(jit_ms)))
  print(_describe("  level_candidates (top-k)",
                  _time(lambda: candidates(logits_dev, config), args.repeats)))
  print(_describe("  beam search with n-gram",
                  _time(lambda: search_only(tokens, log_probs, context_dev,
                                            table, config=config),
                        args.repeats)))
  print(_describe("  beam search without n-gram",
                  _time(lambda: search_only(tokens, log_probs, context_dev,
                                            None, config=config),
                        args.repeats)))
  print(_describe("reference_search (numpy)", np.array(ref_ms)))
  print(f"speed-up jit vs numpy (medians): "
        f"{np.median(ref_ms) / np.median(jit_ms):.0f}x")


if __name__ == "__main__":
  main()
