"""The command line of ``python -m infer.bench`` and what its options load.

The method names, the parser (its DARTree part, ``add_dartree_args``, is shared
with ``infer.main``), the checks of the drafter and tree options, and the
drafters, DART heads and trees they name (``--dartree-budget auto`` and
``--tree-budget auto`` measure theirs with ``dart_jax.tree_budget``).
"""

import argparse
import dataclasses
from typing import Any, Sequence

import dart_jax as dj
from dart_jax.decode.methods import METHODS as REGISTRY
from dart_jax.decode.methods import method_names
from dart_jax.errors import InputError
from dart_jax import sharding
from dart_jax.models import precision
from dart_jax.tree.dartree import DARTreeConfig
from dart_jax import tree_budget as tb

# Views of the one method registry (``dart_jax.decode.methods.METHODS``).
# DARTree methods (``dart_jax.generate``'s ``tree=`` names), baselines first; the
# DFlash ones read only the backbone's uncorrected marginals, the Domino ones need
# the correction head.
DARTREE_METHODS = method_names(family="dartree")
DFLASH_METHODS = method_names(family="dartree", drafter="dflash")
DOMINO_METHODS = method_names(family="dartree", drafter="domino")
# DART-GRU methods -> ``generate``'s ``tree=`` name for a DART-GRU drafter.
DART_GRU_TREES = {m: REGISTRY[m].tree for m in method_names(family="dart_gru")}
DART_GRU_METHODS = tuple(DART_GRU_TREES)
# ``generate`` tree names whose size is ``--dartree-budget`` (chains ignore it).
BUDGET_TREES = tuple(REGISTRY[m].tree for m in DARTREE_METHODS if REGISTRY[m].uses_budget)
# DART with the context N-gram as ``--context-ngram`` says, and always without it.
DART_METHODS = method_names(family="dart")
METHODS = method_names()
# Speculative methods whose greedy output must equal AR's token for token.
LOSSLESS_METHODS = method_names(lossless=True)
# Exit status of infer.bench when a lossless method's greedy output differs from AR's.
GREEDY_MISMATCH_EXIT = 3


# ----------------------------------------------------------------------------
# The parser.
# ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m infer.bench",
      description="Benchmark DART and DARTree speculative decoding against plain "
                  "decoding on MT-Bench and HumanEval (same process, alternating runs).",
      epilog=f"Exit status {GREEDY_MISMATCH_EXIT} if a greedy speculative output "
             "differs from AR's.", formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--method", default="ar,dart",
                 help=f"comma list of {', '.join(METHODS)} (default ar,dart); ar is "
                      "always run as the reference")
  p.add_argument("--dataset", default="mt_bench,humaneval",
                 help="comma list of mt_bench, humaneval, rewrite (our 10 prompts "
                      "that quote a passage; default mt_bench,humaneval)")
  p.add_argument("--limit", type=int, default=10,
                 help="questions/problems per dataset (MT-Bench: each question gives "
                      "two prompts, its two turns; default 10)")
  p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (128)")
  p.add_argument("--temperature", default="0",
                 help="comma list of temperatures, e.g. 0,1 (default 0)")
  p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (1.0 = off)")
  p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
  p.add_argument("--seed", type=int, default=0, help="seed, the same for every method")
  p.add_argument("--json", default=None, help="write all results to this JSON file")
  p.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
  p.add_argument("--model", default=None,
                 help="target: HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
  p.add_argument("--draft", default=None,
                 help="DART head directory, or 'random' for a random head (timing only); "
                      "default for the embedded target: the head shipped with dart-jax")
  p.add_argument("--draft-length", type=int, default=4,
                 help="D of a random head (default 4)")
  p.add_argument("--draft-vocab-size", type=int, default=None,
                 help="draft vocabulary of a random head (default: the target's)")
  p.add_argument("--ngram", default=None,
                 help="N-gram .trie for DART's tree search (default with the shipped "
                      "head: the N-gram shipped with it)")
  p.add_argument("--tree-budget", default=None,
                 help="DART draft nodes per round (remain_total) or 'auto' to choose "
                      "from measured verify costs (see dart_jax/tree_budget.py); default: "
                      "TreeConfig's default, which is large for a CPU")
  p.add_argument("--topk", type=int, default=None,
                 help="tree search top-k per level (default min(25, budget))")
  p.add_argument("--beam-width", type=int, default=None,
                 help="tree search beam width (default min(20, budget))")
  add_context_ngram_flag(p)
  add_dartree_args(p)
  p.add_argument("--hf-threads", type=int, default=None,
                 help="torch threads for the hf method (default: the CPU count; on a "
                      "busy machine 1 can be much faster, see the module docstring)")
  p.add_argument("--profile", action="store_true",
                 help="also run every speculative method once more per prompt with "
                      "per-phase timing (search/verify/accept/draft)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  precision.add_cli_flag(p)
  sharding.add_cli_flag(p)
  return p


def add_context_ngram_flag(p: argparse.ArgumentParser) -> None:
  """``--context-ngram on|off`` (shared with ``infer.main``)."""
  p.add_argument("--context-ngram", choices=("on", "off"), default=None,
                 help="DART's tree search also uses each sequence's own n-grams "
                      "(dart_jax.ngram.context; default on); the bench method "
                      "dart-no-context always runs without them")


def split_arg(value: str, allowed: Sequence[str] | None, what: str) -> list[str]:
  """The comma list ``value`` of ``--what``, without repeats, in order; InputError
  if it is empty or (given ``allowed``) names anything else."""
  items = [v.strip() for v in value.split(",") if v.strip()]
  if not items:
    raise InputError(f"--{what} is empty")
  if allowed is not None:
    bad = [v for v in items if v not in allowed]
    if bad:
      raise InputError(f"unknown --{what} {bad}; choose from {', '.join(allowed)}")
  return list(dict.fromkeys(items))


def add_dartree_args(p: argparse.ArgumentParser) -> None:
  """Drafter and tree options of the DARTree methods (shared with infer.main)."""
  g = p.add_argument_group(
      "DARTree methods", f"drafters and trees of {', '.join(DARTREE_METHODS)}")
  g.add_argument("--dflash", default=None, metavar="DIR",
                 help="DFlash drafter directory for dflash-chain and ddtree (default: "
                      "the --domino drafter's backbone)")
  g.add_argument("--domino", default=None, metavar="DIR",
                 help="Domino drafter directory (DFlash backbone + correction head) for "
                      "domino-chain, dartree-fixed and dartree")
  g.add_argument("--drafter", default=None, metavar="random",
                 help="'random': one randomly initialised Domino drafter for every "
                      "DARTree method, instead of --dflash/--domino (timing only)")
  g.add_argument("--drafter-block-size", type=int, default=16,
                 help="block size B of a random drafter (B-1 draft depths; default 16)")
  g.add_argument("--drafter-layers", type=int, default=1,
                 help="backbone layers of a random drafter (default 1)")
  g.add_argument("--drafter-emb-dim", type=int, default=32,
                 help="correction head width E of a random drafter (default 32)")
  g.add_argument("--drafter-gru-dim", type=int, default=32,
                 help="GRU state size G of a random drafter (default 32)")
  add_dartree_tree_args(g)
  g.add_argument("--dart-gru", default=None, metavar="DIR",
                 help=f"DART-GRU drafter directory (load_dart_gru) for "
                      f"{', '.join(DART_GRU_METHODS)}, or 'random' (a random DART head of "
                      "--draft-length with a random correction; timing only); trees "
                      "take the --dartree-* options")


def add_dartree_tree_args(g) -> None:
  """The ``--dartree-*`` tree-shape flags (read by ``dartree_config``)."""
  defaults = DARTreeConfig()
  g.add_argument("--dartree-budget", default=None, metavar="N|auto",
                 help=f"draft nodes per round: DARTree's B_tree (the fixed variant's "
                      f"total), DDTree's node budget (default {defaults.budget}); "
                      "infer.bench also takes 'auto': for each benched method that "
                      "uses a budget (ddtree, dartree-fixed, dartree, dart-gru, "
                      "dart-gru-fixed) it times the target's verify pass per tree size "
                      "(once, shared) and runs one calibration, then picks the budget "
                      "of the best expected tokens/s (see dart_jax/tree_budget.py)")
  g.add_argument("--dartree-width", type=int, default=None,
                 help=f"dartree (pruned): supertree pairs kept per depth (default "
                      f"{defaults.supertree_width})")
  g.add_argument("--dartree-topk", type=int, default=None,
                 help=f"candidates per depth, top-K of the base logits (default "
                      f"{defaults.topk})")
  g.add_argument("--dartree-depth-bonus", type=float, default=None,
                 help=f"dartree (pruned): per-depth bonus of the final ranking, <= 0 "
                      f"(default {defaults.depth_bonus})")


# ----------------------------------------------------------------------------
# Drafter and tree options: checks and loading.
# ----------------------------------------------------------------------------


# What bench results name as the drafter when it is the one shipped in the package.
SHIPPED_DRAFTER = "shipped"

_DARTREE_OPTIONS = (("topk", "dartree_topk"), ("supertree_width", "dartree_width"),
                    ("budget", "dartree_budget"), ("depth_bonus", "dartree_depth_bonus"))


def dartree_options_given(args) -> list[str]:
  """The ``--dartree-*`` / drafter flags set on the command line."""
  given = [f"--{dest.replace('_', '-')}" for _, dest in _DARTREE_OPTIONS
           if getattr(args, dest) is not None]
  return given + [f"--{name.replace('_', '-')}"
                  for name in ("dflash", "domino", "drafter", "dart_gru")
                  if getattr(args, name) is not None]


def dartree_budget_arg(args) -> int | str | None:
  """``--dartree-budget``: an int >= 1, "auto" or None (not given); InputError
  for anything else."""
  value = args.dartree_budget
  if value is None or value == "auto":
    return value
  try:
    budget = int(value)
  except (TypeError, ValueError):
    budget = None
  if budget is None or budget < 1:
    raise InputError(f"--dartree-budget must be an integer >= 1 or 'auto', got {value!r}")
  return budget


def dartree_config(args, allow_auto: bool = False, base: DARTreeConfig | None = None
                   ) -> DARTreeConfig:
  """``DARTreeConfig`` from the ``--dartree-*`` flags (ConfigError if invalid).

  base: the settings the flags change (a drafter's measured ``tree_config``;
  None = ``DARTreeConfig()``). With ``--dartree-budget auto`` (only if
  ``allow_auto``: infer.bench measures it per method) the budget is left at the
  base's, to be replaced.
  """
  budget = dartree_budget_arg(args)
  if budget == "auto" and not allow_auto:
    raise InputError("--dartree-budget auto is measured by python -m infer.bench (it "
                     "logs the budget it picks); pass an integer number of draft nodes here")
  given = {field: getattr(args, dest) for field, dest in _DARTREE_OPTIONS
           if getattr(args, dest) is not None and field != "budget"}
  if budget is not None and budget != "auto":
    given["budget"] = budget
  return dataclasses.replace(base or DARTreeConfig(), **given)


def auto_dartree_budgets(target, tree_methods: dict[str, tuple[Any, str]],
                         bases: dict[str, DARTreeConfig], log
                         ) -> dict[str, tb.BudgetChoice]:
  """``--dartree-budget auto``: a measured budget per bench method whose tree takes one.

  tree_methods: bench method -> (its drafter, ``generate``'s tree name); chains
  are skipped. bases: bench method -> the tree whose budget is replaced. One
  verify-cost curve of the target, over the sizes every method needs, is timed
  in one pass (with the first method's taps: taps only choose which layer
  outputs a pass returns) and shared; each method then gets its own
  calibration run (``tb.choose_budget``).
  """
  families = {m: tb.dartree_family(drafter, tree, bases[m], label=m)
              for m, (drafter, tree) in tree_methods.items() if tree in BUDGET_TREES}
  if not families:
    log("[dartree-budget] auto: none of the benched methods uses a budget (chains "
        "ignore it)")
    return {}
  sizes = tuple(sorted(set().union(*(tb.verify_sizes(f) for f in families.values()))))
  log(f"[dartree-budget] timing target verify passes for T in {sizes} (shared by "
      f"{', '.join(families)}) ...")
  costs = tb.measure_verify_costs(target, sizes, taps=next(iter(families.values())).taps)
  return {m: tb.choose_budget(target, family, verify_costs=costs, log=log)
          for m, family in families.items()}


def check_drafter_args(args, methods: Sequence[str]) -> None:
  """Raises InputError if the DARTree methods among ``methods`` lack a drafter
  (or get conflicting ones); loads nothing, so it can run before the target."""
  if args.drafter not in (None, "random"):
    raise InputError(f"--drafter takes only 'random' (a random drafter), got "
                     f"{args.drafter!r}; pass drafter directories with --dflash DIR / "
                     "--domino DIR")
  wanted = [m for m in methods if m in DARTREE_METHODS]
  if not wanted:
    return
  if args.drafter is not None and (args.dflash or args.domino):
    raise InputError("--drafter random replaces --dflash/--domino; pass one or the other")
  if args.drafter == "random":
    if args.drafter_block_size < 2:
      raise InputError(f"--drafter-block-size must be >= 2 (the root plus at least one "
                       f"draft depth), got {args.drafter_block_size}")
    for flag in ("drafter_layers", "drafter_emb_dim", "drafter_gru_dim"):
      if getattr(args, flag) < 1:
        raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got "
                         f"{getattr(args, flag)}")
    return
  if args.model is None:
    return  # The embedded target: the drafter shipped for it serves what is not given.
  need_domino = [m for m in wanted if m in DOMINO_METHODS]
  if need_domino and not args.domino:
    plain = (f"; --dflash {args.dflash} gives only the DFlash backbone" if args.dflash
             else "")
    raise InputError(f"--method {','.join(need_domino)} needs a Domino drafter (DFlash "
                     f"backbone + correction head) for --model {args.model}: pass "
                     f"--domino DIR, or --drafter random for a random one (timing "
                     f"only){plain}; the shipped drafter is for the embedded target")
  if not (args.dflash or args.domino):
    raise InputError(f"--method {','.join(wanted)} needs a drafter for --model "
                     f"{args.model}: --dflash DIR (a DFlash drafter), --domino DIR (its "
                     "DFlash backbone serves), or --drafter random (timing only); the "
                     "shipped drafter is for the embedded target")


def load_drafters(args, target, methods: Sequence[str]) -> dict[str, tuple[Any, str]]:
  """The drafter serving each DARTree method in ``methods``: name -> (drafter, source).

  dflash-chain and ddtree use ``--dflash``, else the ``--domino`` drafter (they read
  only its backbone's uncorrected marginals); the other three need ``--domino``.
  On the embedded target (no ``--model``) the Domino drafter shipped for it
  stands in for ``--domino``. ``--drafter random`` makes one random Domino
  drafter for all of them. Raises InputError for missing / conflicting
  drafter flags (``check_drafter_args``),
  CheckpointError / ConfigError for bad directories and drafters made for another
  target (hidden size, vocabulary or layer count).
  """
  check_drafter_args(args, methods)
  wanted = [m for m in methods if m in DARTREE_METHODS]
  if not wanted:
    return {}
  if args.drafter == "random":
    drafter = dj.DFlashDrafter.init(
        target, block_size=args.drafter_block_size, num_layers=args.drafter_layers,
        domino=True, emb_dim=args.drafter_emb_dim, gru_hidden_dim=args.drafter_gru_dim,
        seed=args.seed)
    return {m: (drafter, "random") for m in wanted}
  use_dflash = args.dflash and any(m in DFLASH_METHODS for m in wanted)
  dflash = dj.load_dflash(args.dflash, target) if use_dflash else None
  on_domino = [m for m in wanted if not (m in DFLASH_METHODS and dflash is not None)]
  domino = dj.load_domino(args.domino, target) if on_domino else None  # None: shipped
  out = {m: (domino, str(args.domino or SHIPPED_DRAFTER)) for m in on_domino}
  out.update({m: (dflash, str(args.dflash)) for m in wanted if m not in out})
  return {m: out[m] for m in wanted}


def load_dart_gru_args(args, target, methods: Sequence[str]):
  """The DART-GRU drafter for the dart-gru methods among ``methods`` (None if
  there are none): ``--dart-gru DIR`` or ``random``. Raises InputError without it."""
  wanted = [m for m in methods if m in DART_GRU_METHODS]
  if not wanted:
    return None
  if not args.dart_gru:
    raise InputError(f"--method {','.join(wanted)} needs a DART-GRU drafter: --dart-gru "
                     "DIR (a train.main head.kind=dart_gru export), or --dart-gru random "
                     "(timing only)")
  if args.dart_gru != "random":
    return dj.load_dart_gru(args.dart_gru, target)
  head = dj.DartHead.init(target, draft_length=getattr(args, "draft_length", 4),
                          draft_vocab_size=getattr(args, "draft_vocab_size", None),
                          seed=args.seed)
  return dj.DartGruDrafter.from_head(head, emb_dim=args.drafter_emb_dim,
                                     gru_hidden_dim=args.drafter_gru_dim, seed=args.seed)


def load_dart_args(args, target) -> tuple[Any, Any]:
  """(DART head, N-gram or None) from ``--draft`` / ``--ngram``.

  Without ``--draft`` the embedded target (no ``--model``) uses the head and
  N-gram shipped for it (``--ngram`` still overrides the N-gram); other targets
  need a head directory. ``--draft random`` is a random head (timing only).
  """
  ngram = dj.ngram.NGram.load_trie(args.ngram) if args.ngram else None
  if args.draft is None:
    if args.model is not None:
      raise InputError("--method dart needs --draft: a DART head directory for this "
                       "model, or 'random' for a randomly initialised head (timing only)")
    return dj.load_dart(None, target), ngram if ngram is not None else dj.load_ngram()
  if args.draft == "random":
    return dj.DartHead.init(target, draft_length=getattr(args, "draft_length", 4),
                            draft_vocab_size=getattr(args, "draft_vocab_size", None),
                            seed=args.seed), ngram
  return dj.load_dart(args.draft, target), ngram


def tree_config_from_args(args, target, head, ngram, log) -> tuple[Any, dict]:
  """(DART TreeConfig, how it was chosen) from ``--tree-budget auto|N``, ``--topk``,
  ``--beam-width``; without a budget, the head's own tree (or the default)."""
  if args.tree_budget == "auto":
    choice = tb.auto_tree_budget(target, head, ngram, topk=args.topk,
                                 beam_width=args.beam_width, log=log)
    return choice.tree, {"source": "auto", **choice.to_json()}
  if args.tree_budget is not None:
    try:
      budget = int(args.tree_budget)
    except ValueError:
      raise InputError(f"--tree-budget must be an integer or 'auto', got "
                       f"{args.tree_budget!r}") from None
    if budget < 1:
      raise InputError(f"--tree-budget must be >= 1, got {budget}")
    tree = tb.tree_config_for(budget, args.topk, args.beam_width)
  else:
    given = {k: v for k, v in (("topk", args.topk), ("beam_width", args.beam_width))
             if v is not None}
    # The shipped head carries the tree measured for it.
    tree = dataclasses.replace(head.default_tree(target) or dj.tree.TreeConfig(), **given)
  return tree, {"source": "fixed", "budget": tree.remain_total, "topk": tree.topk,
                "beam_width": tree.beam_width}
