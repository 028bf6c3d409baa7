"""Tree size against plain decoding on development prompts (never benchmark prompts).

  python -m infer.tree_sweep --nodes 3,5,8 [--prompts 32] [--max-new-tokens 96]
  python -m infer.tree_sweep --dartree 8:4:8,12:4:8[:-0.5] [--domino DIR] [--prompts 32]

For each tree of N nodes (DART: top-k = beam width = N, the shipped head and N-gram
of the embedded model unless ``--draft``/``--ngram`` are given), or each DARTree
tree ``budget:width:topk[:depth_bonus]`` (``DARTreeConfig``'s budget,
supertree_width, topk and depth_bonus; the shipped Domino drafter unless
``--domino``) and the drafter's own chain, and for plain decoding: greedy decoding
of ``--prompts`` first user messages of the v2 held-out split (evenly spaced
records), the methods alternating per prompt (the order reversed every other prompt)
in one process so that drift on a shared machine hits all alike. Prints per method
the median tokens/s, the median of the per-prompt ratios to plain decoding, tokens
per round, and how many outputs equal plain decoding's. This is how the shipped
trees were chosen (``dart_jax/assets/smollm2_135m/README.md``).
"""

import argparse
import dataclasses
import json
import lzma
import statistics
import sys

import dart_jax as dj
from dart_jax.tree import DARTreeConfig, TreeConfig
from train.configs import SMOLLM2_V2_HELDOUT


def dev_prompts(count: int, path: str = SMOLLM2_V2_HELDOUT) -> list[str]:
  """The first user message of ``count`` evenly spaced records of ``path`` (a
  ``.jsonl.xz`` of chat records), in file order."""
  with lzma.open(path, "rt", encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  if not 0 < count <= len(records):
    raise dj.InputError(f"--prompts must be in 1..{len(records)} (records in {path}), "
                        f"got {count}")
  step = len(records) // count
  return [records[i * step]["messages"][0]["content"] for i in range(count)]


def dart_trees(head, ngram, nodes: list[int]) -> dict[str, dict]:
  """``generate`` options of DART with trees of N nodes, by name ("N nodes")."""
  return {f"{n} nodes": dict(draft=head, ngram=ngram,
                             tree=TreeConfig(topk=n, beam_width=n, remain_total=n))
          for n in nodes}


def dartree_trees(drafter, trees: list[DARTreeConfig]) -> dict[str, dict]:
  """``generate`` options of the drafter's chain ("domino-chain" with a
  correction head, else "dflash-chain": the baseline a tree must beat) and of
  DARTree (pruned) with each tree, by name ("dartree B:W:K" = budget,
  supertree width, top-K, then ":bonus" where the depth bonus is not the
  default)."""
  chain = "domino-chain" if drafter.domino else "dflash-chain"
  return {chain: dict(draft=drafter, tree=chain)} | {
      f"dartree {_tree_name(t)}": dict(draft=drafter, tree="dartree", tree_config=t)
      for t in trees}


def _tree_name(tree: DARTreeConfig) -> str:
  name = f"{tree.budget}:{tree.supertree_width}:{tree.topk}"
  if tree.depth_bonus != DARTreeConfig().depth_bonus:
    name += f":{tree.depth_bonus:g}"
  return name


def parse_dartree_trees(spec: str, base: DARTreeConfig | None = None
                        ) -> list[DARTreeConfig]:
  """``"8:4:8,12:4:8:-0.5"`` -> DARTreeConfigs (budget:width:topk, then an
  optional depth bonus, over ``base``)."""
  trees = []
  for item in spec.split(","):
    fields = item.split(":")
    try:
      if len(fields) not in (3, 4):
        raise ValueError
      budget, width, topk = (int(v) for v in fields[:3])
      bonus = float(fields[3]) if len(fields) == 4 else None
    except ValueError:
      raise dj.InputError(f"--dartree takes budget:width:topk[:depth_bonus] items, e.g. "
                          f"8:4:8 or 8:4:8:-0.5, got {item!r}") from None
    tree = dataclasses.replace(base or DARTreeConfig(), budget=budget,
                               supertree_width=width, topk=topk)
    trees.append(tree if bonus is None else dataclasses.replace(tree, depth_bonus=bonus))
  return trees


def sweep(target, methods: dict[str, dict], prompts: list, max_new_tokens: int
          ) -> dict[str, dict]:
  """{"ar" | name: {"tokens_per_s": [...], "accept": [...], "tokens": [...]}},
  one entry per prompt (text, or token ids) in each list; methods: name ->
  ``generate`` options (``dart_trees``, ``dartree_trees``)."""
  methods = {"ar": {}} | methods
  for kwargs in methods.values():  # compile every method first
    dj.generate(target, prompts[0], max_new_tokens=8, temperature=0.0, **kwargs)
  runs = {name: {"tokens_per_s": [], "accept": [], "tokens": []} for name in methods}
  for i, prompt in enumerate(prompts):
    for name in (list(methods) if i % 2 == 0 else list(reversed(methods))):
      out = dj.generate(target, prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                        **methods[name])
      runs[name]["tokens_per_s"].append(out.stats.tokens_per_s)
      runs[name]["accept"].append(out.stats.mean_accept_len)
      runs[name]["tokens"].append(out.tokens)
  return runs


def report(runs: dict[str, dict]) -> str:
  """One line per method: median tok/s, median ratio to AR, tokens/round, == AR."""
  ar = runs["ar"]
  lines = []
  for name, run in runs.items():
    ratios = [r / a for r, a in zip(run["tokens_per_s"], ar["tokens_per_s"])]
    same = sum(t == a for t, a in zip(run["tokens"], ar["tokens"]))
    lines.append(f"{name:>17}: {statistics.median(run['tokens_per_s']):6.1f} tok/s, "
                 f"{statistics.median(ratios):.3f}x of AR (median), "
                 f"{statistics.mean(run['accept']):.3f} tokens/round, "
                 f"greedy == AR {same}/{len(ratios)}")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--nodes", default="3,5,8", help="tree sizes, comma-separated")
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--max-new-tokens", type=int, default=96)
  p.add_argument("--draft", default=None, help="a DART head directory (default: shipped)")
  p.add_argument("--ngram", default=None, help="an N-gram trie (default: shipped)")
  p.add_argument("--dartree", default=None, metavar="B:W:K,...",
                 help="sweep DARTree (pruned) trees instead: budget:width:topk items, "
                 "each with an optional :depth_bonus (<= 0)")
  p.add_argument("--domino", default=None,
                 help="a Domino drafter directory for --dartree (default: shipped)")
  args = p.parse_args(argv)
  try:
    prompts = dev_prompts(args.prompts)
    if args.dartree:
      trees = parse_dartree_trees(args.dartree)
      target = dj.load_target()
      methods = dartree_trees(dj.load_domino(args.domino, target), trees)
    else:
      nodes = [int(n) for n in args.nodes.split(",")]
      if any(n < 1 for n in nodes):
        raise dj.InputError(f"--nodes must be positive, got {args.nodes}")
      target = dj.load_target()
      head = dj.load_dart(args.draft, target)  # None: the shipped head and N-gram
      methods = dart_trees(head, dj.load_ngram(args.ngram), nodes)
  except dj.DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report(sweep(target, methods, prompts, args.max_new_tokens)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
