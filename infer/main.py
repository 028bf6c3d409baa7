"""Command-line generation: ``python -m infer.main --prompt "..."``.

Streams the answer of the target model (the embedded SmolLM2-135M-Instruct by
default), plainly or with speculative decoding: DART (``--draft``) or a DARTree
method (``--method dartree|dartree-fixed|ddtree|dflash-chain|domino-chain`` with
``--domino`` / ``--dflash`` drafters, on the embedded target the shipped Domino
drafter; see ``infer.bench`` for which drafter serves which method) or DART-GRU
(``--method dart-gru|dart-gru-fixed|dart-gru-chain`` with ``--dart-gru DIR``).
Speculative decoding gives the same output, faster.
"""

import argparse
import statistics
import sys

import dart_jax as dj
from dart_jax.decode.methods import METHODS as REGISTRY
from dart_jax.decode.methods import method_names
from dart_jax import sharding
from dart_jax.models import precision
from infer import bench_options

# The registry's methods this CLI runs; DART's context N-gram is --context-ngram here.
METHODS = tuple(m for m in method_names(family=("ar", "dart", "dartree", "dart_gru"))
                if REGISTRY[m].context_ngram)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m infer.main",
      description="Generate text with a target model, optionally with DART or DARTree "
                  "speculative decoding (same output, faster).")
  p.add_argument("--prompt", required=True,
                 help="user message (the chat template is applied unless --no-chat)")
  p.add_argument("--model", default=None,
                 help="HF model directory or .gguf file (default: the embedded "
                      "SmolLM2-135M-Instruct)")
  p.add_argument("--method", "--tree", default=None, choices=METHODS,
                 help="decoding method (dart_jax.generate's tree= names for DARTree); "
                      "default: dart with --draft/--ngram/--tree-budget, dartree with "
                      "--domino or --drafter random, ddtree with only --dflash, dart-gru "
                      "with --dart-gru, else ar. "
                      "--method dart on the embedded target uses the shipped head, "
                      "the DARTree methods the shipped Domino drafter")
  p.add_argument("--draft", default=None,
                 help="DART head directory (reference format); enables DART (default "
                      "for the embedded target: the head shipped with dart-jax)")
  p.add_argument("--ngram", default=None,
                 help="N-gram .trie file for DART's tree search (default with the "
                      "shipped head: the N-gram shipped with it)")
  p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate (256)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0 = greedy (default)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
  p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
  p.add_argument("--seed", type=int, default=0, help="random seed")
  p.add_argument("--tree-budget", type=int, default=None,
                 help="DART: draft nodes verified per round (remain_total)")
  bench_options.add_context_ngram_flag(p)
  p.add_argument("--no-chat", action="store_true", help="use the prompt as raw text")
  p.add_argument("--stats", action="store_true", help="print statistics to stderr")
  p.add_argument("--compare", action="store_true",
                 help="with a speculative method: also decode the prompt plainly, "
                      "then run both 3 more times each, alternating, now that they "
                      "are compiled, and print both median warm rates and the "
                      "speedup (implies --stats)")
  precision.add_cli_flag(p)
  sharding.add_cli_flag(p)
  bench_options.add_dartree_args(p)
  return p


def choose_method(args) -> str:
  """The method to run; raises InputError for options that do not fit it."""
  method = args.method
  if method is None:
    if args.draft or args.ngram or args.tree_budget or args.context_ngram:
      method = "dart"
    elif args.dart_gru:
      method = "dart-gru"
    elif args.domino or args.drafter:
      method = "dartree"
    elif args.dflash:
      method = "ddtree"
    else:
      method = "ar"
  dart_flags = [f for f, v in (("--draft", args.draft), ("--ngram", args.ngram),
                               ("--tree-budget", args.tree_budget),
                               ("--context-ngram", args.context_ngram)) if v]
  dartree_flags = bench_options.dartree_options_given(args)
  if method == "ar":
    if dart_flags or dartree_flags:
      raise dj.InputError(f"{', '.join(dart_flags + dartree_flags)}: only for "
                          "speculative decoding; pass --draft DIR for DART, or --domino "
                          "DIR / --dflash DIR (and --method) for DARTree")
  elif method == "dart":
    if not args.draft and args.model is not None:
      raise dj.InputError("--method dart needs --draft: a DART head directory for "
                          "this model (the shipped head is for the embedded target)")
    if dartree_flags:
      raise dj.InputError(f"{', '.join(dartree_flags)} are DARTree options; --method "
                          "dart takes --draft, --ngram, --tree-budget and "
                          "--context-ngram")
  elif dart_flags:
    raise dj.InputError(f"{', '.join(dart_flags)} are DART options; --method {method} "
                        "takes --domino / --dflash / --drafter random (DART-GRU: "
                        "--dart-gru) and --dartree-*")
  elif method in bench_options.DART_GRU_METHODS:
    others = [f for f in dartree_flags if f in ("--dflash", "--domino", "--drafter")]
    if others:
      raise dj.InputError(f"{', '.join(others)}: DARTree drafters; --method {method} "
                          "takes --dart-gru DIR and --dartree-*")
    if not args.dart_gru:
      raise dj.InputError(f"--method {method} needs --dart-gru DIR (or random)")
  else:
    if args.dart_gru:
      raise dj.InputError(f"--dart-gru is for the DART-GRU methods, not --method {method}")
    bench_options.check_drafter_args(args, [method])
  return method


def stats_line(method: str, s) -> str:
  """One line of a call's ``GenerateStats``."""
  compiling = f" ({s.compile_s:.1f}s of it compiling)" if s.compile_s > 0 else ""
  return (f"[{method}: {s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s{compiling}, "
          f"{s.mean_accept_len:.2f} tokens/round, first token "
          f"{s.time_to_first_token_s:.2f}s]")


COMPARE_RUNS = 3


def compare_line(target, args, method: str, kwargs: dict) -> str:
  """Plain decoding of the same prompt (compiled by a first run), then
  ``COMPARE_RUNS`` warm runs of each method, alternating (ar, method, method,
  ar, ...) so that drift on a shared machine hits both alike: their median
  tokens/s, as a new user's later calls would see them."""
  def run(**method_kwargs):
    return dj.generate(target, args.prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, chat=not args.no_chat, **method_kwargs).stats

  run()  # compiles plain decoding
  rates = {"ar": [], method: []}
  accept_lens = []
  for index in range(COMPARE_RUNS):
    for name in (("ar", method) if index % 2 == 0 else (method, "ar")):
      stats = run() if name == "ar" else run(**kwargs)
      rates[name].append(stats.tokens_per_s)
      if name != "ar":
        accept_lens.append(stats.mean_accept_len)
  plain, spec = statistics.median(rates["ar"]), statistics.median(rates[method])
  speedup = spec / plain if plain else 0.0
  return (f"[warm, median of {COMPARE_RUNS} alternating runs: {method} {spec:.1f} tok/s "
          f"({statistics.median(accept_lens):.2f} tokens/round), ar {plain:.1f} tok/s: "
          f"{speedup:.2f}x]")


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    method = choose_method(args)
    tree_methods = bench_options.DARTREE_METHODS + bench_options.DART_GRU_METHODS
    if method in tree_methods:
      bench_options.dartree_config(args)  # Bad --dartree-* values fail before loading.
    mesh = sharding.mesh_from_flag(args.mesh)  # before anything else starts JAX
    target = dj.load_target(args.model, dtype=precision.resolve_flag(args.precision),
                            mesh=mesh)
    kwargs = {}
    if method == "dart":
      kwargs["draft"], kwargs["ngram"] = bench_options.load_dart_args(args, target)
      if args.tree_budget:
        kwargs["tree"] = dj.tree.TreeConfig(remain_total=args.tree_budget)
      kwargs["context_ngram"] = args.context_ngram != "off"
    elif method in tree_methods:
      if method in bench_options.DART_GRU_METHODS:
        drafter = bench_options.load_dart_gru_args(args, target, [method])
        tree = bench_options.DART_GRU_TREES[method]
      else:
        drafter, _ = bench_options.load_drafters(args, target, [method])[method]
        tree = method
      # The flags change the drafter's measured settings (the shipped drafter's).
      kwargs.update(draft=drafter, tree=tree, tree_config=bench_options.dartree_config(
          args, base=drafter.tree_config))
    stream = dj.generate_stream(
        target, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, chat=not args.no_chat, stats_out=(stats := {}), **kwargs)
    for chunk in stream:
      sys.stdout.write(chunk)
      sys.stdout.flush()
    sys.stdout.write("\n")
    if (args.stats or args.compare) and stats:
      print(stats_line(method, stats["stats"]), file=sys.stderr)
    if args.compare and method != "ar":
      print(compare_line(target, args, method, kwargs), file=sys.stderr)
  except dj.DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
