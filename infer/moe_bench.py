"""Mixture-of-experts forward cost: does it follow the experts chosen, not all of them?

  python -m infer.moe_bench [--experts 8,64] [--tokens 1,9,64] [--precision fast]
      [--json out.json]

Two random Qwen3-MoE targets with the same active parameters (top-2 experts of the
same size per token) but 8 and 64 experts; one forward pass over T new tokens with
192 cached tokens (T=1 a decode step, T=9 the shipped DART tree, T=64 a large tree or
a prefill chunk), median of interleaved repetitions in one process. The ratio of the
E=64 model's time to the E=8 model's is the cost of carrying more experts that a
token does not use (1.0 = none). Also reports each expert formulation forced
(``gather`` / ``sorted``, see ``dart_jax.models.moe``) next to ``auto``.
"""

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dart_jax.models import ModelConfig, Target, causal_mask, precision
from dart_jax.models import moe as moe_lib

BASE = ModelConfig(arch="qwen3_moe", vocab_size=8192, hidden_size=576,
                   intermediate_size=1536, num_layers=4, num_heads=9, num_kv_heads=3,
                   head_dim=64, qk_norm=True, max_position_embeddings=1024,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
                   sparse_layers=(0, 1, 2, 3))
CONTEXT = 192


def _with_impl(target: Target, impl: str) -> Target:
  """The same model with every MoE layer forced to one expert formulation."""
  module = target.module()
  for layer in module.layers:
    if isinstance(layer.mlp, moe_lib.MoE):
      layer.mlp.expert_impl = impl
  graphdef, params = nnx.split(module)
  return dataclasses.replace(target, graphdef=graphdef, params=params)


def _timer(target: Target, t: int, vocab: int):
  """A function timing one target pass over t tokens after CONTEXT cached ones."""
  cache = target.new_cache(1, CONTEXT + t)
  cache = cache.replace(lengths=jnp.asarray([CONTEXT], jnp.int32))
  tokens = jnp.asarray(np.arange(t) % vocab, jnp.int32)[None]
  positions = (CONTEXT + jnp.arange(t, dtype=jnp.int32))[None]
  mask = causal_mask(1, t)

  def run() -> float:
    nonlocal cache
    start = time.perf_counter()
    out = target.forward(tokens, positions, cache, mask, attend_len=CONTEXT + t)
    out.logits.block_until_ready()
    cache = out.cache.replace(lengths=jnp.asarray([CONTEXT], jnp.int32))
    return time.perf_counter() - start

  run()  # compile
  return run


def measure(experts, tokens, mode, impls, reps: int, base: ModelConfig = BASE,
            log=print) -> dict:
  """Median ms per pass for each (formulation, T, E); ``results["ms"]``."""
  targets = {e: Target.init(dataclasses.replace(base, num_experts=e), seed=0, dtype=mode)
             for e in experts}
  results = {"precision": mode.name, "config": {k: v for k, v in dataclasses.asdict(base).items()
                                                if k not in ("rope_scaling",)},
             "context": CONTEXT, "ms": {}}
  for impl in impls:
    for t in tokens:
      timers = {e: _timer(_with_impl(targets[e], impl), t, base.vocab_size)
                for e in experts}
      samples = {e: [] for e in experts}
      for _ in range(reps):  # interleaved: drift of a shared machine cancels
        for e in experts:
          samples[e].append(timers[e]())
      ms = {e: 1e3 * float(np.median(s)) for e, s in samples.items()}
      ratio = ms[experts[-1]] / ms[experts[0]]
      results["ms"][f"{impl}/T={t}"] = {str(e): round(v, 3) for e, v in ms.items()} | {
          "ratio": round(ratio, 3)}
      log(f"{impl:>6} T={t:<3} " + "  ".join(f"E={e}: {v:7.2f} ms" for e, v in ms.items())
          + f"  E={experts[-1]}/E={experts[0]}: {ratio:.2f}x")
  return results


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.moe_bench", description=__doc__.split(
      "\n\n")[0])
  p.add_argument("--experts", default="8,64", help="comma list of expert counts (8,64)")
  p.add_argument("--tokens", default="1,9,64", help="comma list of tokens per pass")
  p.add_argument("--impls", default="auto,gather,sorted",
                 help="expert formulations to time (auto,gather,sorted)")
  p.add_argument("--reps", type=int, default=9, help="repetitions per cell (median)")
  p.add_argument("--json", default=None, help="write the results to this file")
  precision.add_cli_flag(p)
  args = p.parse_args(argv)
  experts = [int(e) for e in args.experts.split(",")]
  tokens = [int(t) for t in args.tokens.split(",")]
  impls = args.impls.split(",")
  mode = precision.resolve_flag(args.precision)
  print(f"[moe_bench] {jax.devices()[0].platform}, {mode.name} mode, top-"
        f"{BASE.num_experts_per_tok} of E experts, {CONTEXT} cached tokens", file=sys.stderr)
  results = measure(experts, tokens, mode, impls, args.reps)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
