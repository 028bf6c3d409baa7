"""Train a drafter: ``python -m train.main --config NAME_OR_FILE --workdir DIR [k=v ...]``.

A DART head (``head.kind=dart``, presets tiny, smollm2_dart, qwen3_8b_dart), a
DFlash / Domino drafter (``head.kind=dflash|domino``, presets tiny_dflash,
tiny_domino, smollm2_domino, qwen3_8b_dflash, qwen3_8b_domino), or a GRU
correction of a frozen DART head (``head.kind=dart_gru``, presets
tiny_dart_gru, smollm2_dart_gru; the head from ``head.init_from=DIR``).

Examples:
  python -m train.main --config tiny --workdir /tmp/dart_tiny
  python -m train.main --config tiny_domino --workdir /tmp/domino_tiny
  python -m train.main --config smollm2_dart --workdir ckpt/smollm2 \
      data.train=regen.jsonl steps=5000 batch_size=16
  python -m train.main --config qwen3_8b_dart --workdir gs://bucket/qwen3_8b \
      target.path=/mnt/Qwen3-8B data.train=a.jsonl,b.jsonl

Rerunning the same command resumes from the latest checkpoint in the workdir.
The final head is written in the reference format to ``WORKDIR/export`` (load
it with ``dart_jax.load_dart``); a DFlash / Domino drafter in the released format
(``dart_jax.load_dflash`` / ``load_domino``; ``generate(..., tree="dartree")``); a
DART-GRU drafter as the DART head plus ``correction.json`` / ``correction.safetensors``
(``dart_jax.load_dart_gru``).

TPU pod slices: run the same command on every worker, e.g.

  gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command \
    "cd dart-jax && python -m train.main --config qwen3_8b_dart \
     --workdir gs://BUCKET/run1 target.path=/mnt/Qwen3-8B data.train=/mnt/data.jsonl"

``jax.distributed.initialize()`` is tried first thing (``distributed=auto``; the
ValueError of a single host means "single host"; ``distributed=on|off`` forces
it); every host reads the
data and takes its slice of each global batch, only host 0 logs and exports,
and all hosts write the checkpoints together (use a shared path such as gs://).
"""

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m train.main",
      description="Train a DART head, a DFlash / Domino drafter or a DART-GRU "
                  "correction for a target model.",
      epilog="Overrides are dotted config keys, e.g. optim.learning_rate=1e-3 steps=500 "
             "data.train=a.jsonl,b.jsonl mesh.fsdp=4 head.kind=domino dflash.block_size=8. "
             "Presets: tiny, smollm2_dart, qwen3_8b_dart, tiny_dflash, tiny_domino, "
             "smollm2_domino, qwen3_8b_dflash, qwen3_8b_domino, tiny_dart_gru, "
             "smollm2_dart_gru.")
  p.add_argument("--config", required=True, help="preset name or JSON config file")
  p.add_argument("--workdir", required=True,
                 help="checkpoints, metrics.jsonl and the exported drafter go here")
  p.add_argument("overrides", nargs="*", help="key=value config overrides")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved config and exit")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                      datefmt="%H:%M:%S")
  # Keep third-party chatter (Orbax, absl) out of the progress output.
  for name in ("absl", "orbax", "jax._src"):
    logging.getLogger(name).setLevel(logging.WARNING)
  from dart_jax.errors import DartJaxError
  from train import configs, overrides

  try:
    config = overrides.load_config(args.config, args.overrides)
    if args.print_config:
      import json
      print(json.dumps(configs.to_dict(config), indent=2))
      return 0
    from dart_jax import sharding
    sharding.maybe_initialize_distributed(config.distributed)  # before any JAX call
    import jax
    if jax.process_index() != 0:
      logging.getLogger().setLevel(logging.WARNING)
    from train import loop
    result = loop.train(config, args.workdir)
  except DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  last = {r["split"]: r for r in result.history}
  for split in ("train", "eval"):
    if split in last:
      r = last[split]
      print(f"final {split}: loss {r['loss']:.4f} acc {[round(a, 3) for a in r['acc']]} "
            f"accept_len {r['accept_len']:.3f}")
  if result.export_dir:
    what = "head" if config.head.kind == "dart" else f"{config.head.kind} drafter"
    print(f"{what} written to {result.export_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
