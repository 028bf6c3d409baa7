"""Packs a trained DART head and an N-gram into the files dart-jax ships.

  python -m train.embedded_assets --data regen.jsonl --head WORKDIR/export \
      --out dart_jax/assets/smollm2_135m [--order 3 --min-count 2 --tree-budget auto]

- N-gram: every conversation of ``--data`` is rendered with the target's chat
  template and tokenized exactly as training does (``train.data``), then counted
  (order ``--order``) and pruned (``--min-count``, spec ``reduce``) into the
  reference ``.trie`` format. Counting chat-rendered tokens (not raw text) gives
  the N-gram the same token contexts the decoder sees.
- Head: the exported head is re-saved with float16 weights (half the bytes; the
  drafts only steer the speculation, outputs stay the target's).
- Tree: ``--tree-budget auto`` measures this machine's verify costs and the
  head's acceptance (``dart_jax.tree_budget``) and stores the chosen ``TreeConfig``
  fields; ``dj.load_dart()`` hands them to ``generate`` as the shipped head's
  default tree. An integer fixes the budget instead.
- ``manifest.json`` records sizes, the tree and the inputs' SHA-256, so a rebuilt
  asset can be checked against the shipped one.

  python -m train.embedded_assets --domino WORKDIR/best --out dart_jax/assets/smollm2_135m \
      --dartree-budget 12 --dartree-width 4 --dartree-topk 8

- Drafter: a trained Domino drafter (DFlash backbone + correction head) is
  re-saved with float16 weights as ``domino/``, and its DARTree settings (the
  ``--dartree-*`` flags over ``DARTreeConfig``'s defaults) go into the
  manifest's ``dartree``; ``dj.load_domino()`` attaches them to the shipped
  drafter. The head, N-gram and drafter are packed by separate calls; each keeps
  the other's manifest entries.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import sys

import numpy as np

import dart_jax as dj
from infer import bench_options
from train import data as data_lib


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def build_ngram(target, data_paths, order: int, min_count: int) -> dj.ngram.NGram:
  """N-gram over the chat-rendered token ids of every record of ``data_paths``."""
  stats = data_lib.DataStats()
  records = data_lib.read_records(data_paths, stats)
  data_lib.warn_malformed(stats)
  examples = data_lib.tokenize_records(target.tokenizer, records, stats)
  ngram = dj.ngram.NGram.build([e.tokens for e in examples], order=order)
  return ngram.reduce(min_count) if min_count > 1 else ngram


def choose_tree(target, head, ngram, tree_budget: str) -> tuple[dict, dict]:
  """(TreeConfig fields, how they were chosen) for ``--tree-budget auto|N``."""
  args = argparse.Namespace(tree_budget=tree_budget, topk=None, beam_width=None)
  tree, how = bench_options.tree_config_from_args(args, target, head, ngram, print)
  fields = {"topk": tree.topk, "beam_width": tree.beam_width,
            "remain_total": tree.remain_total}
  return fields, how


def _update_manifest(out_dir: str, entries: dict, files: list[str],
                     stale: tuple[str, ...] = ()) -> dict:
  """Merges ``entries`` and the sizes of ``files`` into ``out_dir/manifest.json``
  (entries of the other packing call are kept, ``stale`` ones dropped); returns
  the manifest."""
  path = os.path.join(out_dir, "manifest.json")
  manifest = {}
  if os.path.exists(path):
    with open(path) as f:
      manifest = json.load(f)
  for key in stale:
    manifest.pop(key, None)
  sizes = dict(manifest.get("files", {}))
  sizes.update({os.path.relpath(f, out_dir): os.path.getsize(f) for f in files})
  manifest.update(entries, files=dict(sorted(sizes.items())))
  with open(path, "w") as f:
    json.dump(manifest, f, indent=2)
  return manifest


def pack_drafter(target, drafter_dir: str, out_dir: str,
                 tree: dj.tree.DARTreeConfig) -> dict:
  """Writes ``out_dir/domino/`` (float16) and the manifest's ``domino`` and
  ``dartree`` (``tree``'s fields) entries; returns the manifest."""
  drafter = dj.load_domino(drafter_dir, target)
  drafter_out = os.path.join(out_dir, "domino")
  dj.save_dflash(drafter, drafter_out, dtype=np.float16)
  c = drafter.config
  entries = {"domino": {"block_size": c.block_size, "num_layers": c.num_layers,
                        "target_layer_ids": list(c.target_layer_ids),
                        "emb_dim": c.emb_dim, "gru_hidden_dim": c.gru_hidden_dim},
             "dartree": dataclasses.asdict(tree)}
  return _update_manifest(out_dir, entries, [os.path.join(drafter_out, "config.json"),
                                             os.path.join(drafter_out, "model.safetensors")])


def pack(target, data_paths, head_dir: str, out_dir: str, *, order: int = 3,
         min_count: int = 2, tree_budget: str = "8") -> dict:
  """Writes ``out_dir/{dart_head/, ngram.trie, manifest.json}``; returns the manifest."""
  os.makedirs(out_dir, exist_ok=True)
  head = dj.load_dart(head_dir, target)
  head_out = os.path.join(out_dir, "dart_head")
  dj.save_dart(head, head_out, dtype=np.float16)
  trie_path = os.path.join(out_dir, "ngram.trie")
  ngram = build_ngram(target, data_paths, order, min_count)
  ngram.save_trie(trie_path)
  tree, tree_choice = choose_tree(target, head, ngram, tree_budget)
  files = [os.path.join(head_out, "config.json"), os.path.join(head_out, "model.safetensors"),
           trie_path]
  entries = {
      "target": os.path.basename(target.source) or "embedded",
      "draft_length": head.config.draft_length,
      "draft_vocab_size": head.config.draft_vocab_size,
      "ngram_order": order, "ngram_min_count": min_count,
      "tree": tree, "tree_choice": tree_choice,
      "data": {os.path.basename(p): _sha256(p) for p in data_paths},
  }
  # A tree measured for panel targets belonged to the head packed before.
  return _update_manifest(out_dir, entries, files,
                          stale=("tree_panels", "tree_panels_choice"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.embedded_assets",
                              description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
  p.add_argument("--data", nargs="+", default=None,
                 help="chat JSONL the head was trained on (with --head)")
  p.add_argument("--head", default=None, help="exported DART head directory")
  p.add_argument("--domino", default=None,
                 help="exported Domino drafter directory (packed as domino/)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--order", type=int, default=3)
  p.add_argument("--min-count", type=int, default=2)
  p.add_argument("--tree-budget", default="8",
                 help="'auto' (measure, see dart_jax/tree_budget.py) or draft nodes per round")
  bench_options.add_dartree_tree_args(p)
  args = p.parse_args(argv)
  try:
    if not (args.head or args.domino):
      raise dj.InputError("nothing to pack: pass --head DIR (with --data) and/or "
                          "--domino DIR")
    if args.head and not args.data:
      raise dj.InputError("--head needs --data: the chat JSONL the head was trained on "
                          "(the N-gram is counted from it)")
    tree = bench_options.dartree_config(args) if args.domino else None
    target = dj.load_target(args.model)
    manifest = None
    if args.head:
      manifest = pack(target, args.data, args.head, args.out, order=args.order,
                      min_count=args.min_count, tree_budget=args.tree_budget)
    if args.domino:
      manifest = pack_drafter(target, args.domino, args.out, tree)
  except dj.DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(manifest, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
