"""Benchmark: ``kernels.cpu_matmul`` against XLA's dot at the embedded model's shapes.

  python -m kernels.cpu_matmul.bench [--rows 1,2,9,16,33,64,256] [--reps 15] [--json out.json]

For each dense shape of SmolLM2-135M (tied LM head 576 x 49152, MLP up 576 x
1536, MLP down 1536 x 576, K/V projection 576 x 192) and row count M: XLA's
float32 dot in both weight layouts, the kernel on float32 and bf16 ``[N, K]``
weights, and its panel form on bf16 ``[N / 8, K, 8]`` panels. Median ms; the forms alternate within each repetition so that drift on
a shared machine hits all alike.
"""

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpu_matmul, timing

SHAPES = {"lm_head": (576, 49152), "mlp_up": (576, 1536), "mlp_down": (1536, 576),
          "kv_proj": (576, 192)}


def table(rows, reps: int) -> dict:
  """{shape: {M: {form: median ms}}}."""
  forms = {
      "xla_f32_kn": (False, jnp.float32, jax.jit(lambda x, w: x @ w)),
      "xla_f32_nk": (True, jnp.float32, jax.jit(
          lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))),
      "kernel_f32": (True, jnp.float32, jax.jit(cpu_matmul.rows_matmul)),
      "kernel_bf16": (True, jnp.bfloat16, jax.jit(cpu_matmul.rows_matmul)),
      "panels_bf16": ("panels", jnp.bfloat16, jax.jit(cpu_matmul.panels_matmul)),
  }
  rng = np.random.default_rng(0)
  out = {}
  for name, (k, n) in SHAPES.items():
    w_nk = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    layouts = {True: w_nk, False: np.ascontiguousarray(w_nk.T),
               "panels": np.ascontiguousarray(cpu_matmul.to_panels(w_nk))}
    weights = {f: jnp.asarray(layouts[layout], dtype)
               for f, (layout, dtype, _) in forms.items()}
    out[name] = {}
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      times = {f: [] for f in forms}
      for rep in range(reps):
        for f in (forms if rep % 2 == 0 else list(reversed(forms))):
          times[f] += timing.time_calls(forms[f][2], (x, weights[f]), 1)
      out[name][m] = {f: 1e3 * statistics.median(t) for f, t in times.items()}
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="1,2,9,16,33,64,256")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if not cpu_matmul.available():
    p.error("kernels.cpu_matmul does not run here (x86-64 Linux, AVX2 + FMA, a compiler)")
  result = table([int(r) for r in args.rows.split(",")], args.reps)
  forms = list(next(iter(next(iter(result.values())).values())))
  print(f"{'shape':<9} {'M':>4} " + " ".join(f"{f:>12}" for f in forms) + "   (ms)")
  for name, by_rows in result.items():
    for m, row in by_rows.items():
      print(f"{name:<9} {m:>4} " + " ".join(f"{row[f]:12.2f}" for f in forms))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"ms": result, "cpu_flags": sorted(cpu_matmul.cpu_flags() & {
          "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
