"""Benchmark: tree-attention kernel vs the XLA reference.

  python -m kernels.tree_attention.bench [--reps 30] [--dtype bfloat16] [--impl auto]

On TPU / GPU it times the backend's kernel (``impl="auto"``) against the XLA
reference at decode / tree-verify / prefill shapes: median milliseconds of
alternating runs (kernel, XLA, kernel, ...), so drifts in clock or load hit
both. On CPU each Pallas kernel runs once in interpret mode on reduced shapes
for correctness only, and the CPU's own kernel (``cpu_fused``: the fused FFI
call ``impl="xla"`` takes for head-major caches, ``kernels.cpu_matmul``) is
timed against the XLA reference on the same head-major caches, at the embedded
SmolLM2's attention shapes.
"""

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.tree_attention import common
from kernels.tree_attention import ops
from kernels.tree_attention.reference import tree_attention_reference

CPU_FUSED = "cpu_fused"  # the CPU FFI kernel, timed on head-major caches


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  batch: int
  num_tree: int  # T
  cache_size: int  # S, capacity
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  fill: float  # lengths ~ fill * S
  causal: bool = False


DEVICE_SHAPES = (
    Shape("decode", 1, 1, 4096, 32, 8, 128, 0.75),
    Shape("decode_b8", 8, 1, 4096, 32, 8, 128, 0.5),
    Shape("verify_t61", 1, 61, 4096, 32, 8, 128, 0.5),
    Shape("verify_t61_long", 1, 61, 32768, 32, 8, 128, 0.25),
    Shape("verify_t61_b8", 8, 61, 2048, 32, 8, 128, 0.5),
    Shape("verify_t256", 1, 256, 8192, 32, 8, 128, 0.5),
    Shape("verify_small_model", 4, 61, 2048, 14, 2, 64, 0.5),
    Shape("prefill_512", 1, 512, 4096, 32, 8, 128, 0.0, causal=True),
)
# CPU: interpret mode is slow, so small shapes (correctness only).
CPU_SHAPES = (
    Shape("decode", 2, 1, 256, 8, 2, 64, 0.75),
    Shape("verify_t61", 1, 61, 512, 8, 2, 64, 0.5),
    Shape("verify_t61_b2", 2, 61, 256, 6, 2, 64, 0.5),
    Shape("prefill_64", 1, 64, 256, 4, 4, 32, 0.0, causal=True),
)
# CPU, the fused kernel: SmolLM2-135M's attention (9 query / 3 KV heads of 64).
CPU_FUSED_SHAPES = (
    Shape("smollm2_decode", 1, 1, 512, 9, 3, 64, 0.4),
    Shape("smollm2_verify_t6", 1, 6, 512, 9, 3, 64, 0.4),
    Shape("smollm2_verify_t33", 1, 33, 512, 9, 3, 64, 0.4),
    Shape("smollm2_decode_b64", 64, 1, 512, 9, 3, 64, 0.5),
)


def make_inputs(shape: Shape, dtype: jnp.dtype, seed: int = 0):
  """Random operands; random ancestor trees (or causal), per-row lengths."""
  rng = np.random.default_rng(seed)
  b, t, s = shape.batch, shape.num_tree, shape.cache_size
  hq, hkv, hd = shape.num_q_heads, shape.num_kv_heads, shape.head_dim

  def normal(*dims):
    return jnp.asarray(rng.standard_normal(dims, dtype=np.float32), dtype)

  if shape.causal:
    mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
  else:
    mask = np.zeros((b, t, t), bool)
    for row in range(b):
      parents = [rng.integers(-1, i) if i else -1 for i in range(t)]
      for i in range(t):
        j = i
        while j >= 0:
          mask[row, i, j] = True
          j = parents[j]
  top = max(1, int(shape.fill * s))
  lengths = rng.integers(top // 2, top + 1, size=b) if shape.fill else np.zeros(b)
  return (normal(b, t, hq, hd), normal(b, s, hkv, hd), normal(b, s, hkv, hd),
          jnp.asarray(lengths, jnp.int32), normal(b, t, hkv, hd), normal(b, t, hkv, hd),
          jnp.asarray(mask))


def _time_ms(fn, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) * 1e3


def bench_shape(shape: Shape, dtype: jnp.dtype, impl: str, reps: int, on_cpu: bool):
  """Returns (xla_ms, kernel_ms or None, max |kernel - xla|). ``impl`` CPU_FUSED
  compares on head-major caches; Pallas kernels on CPU run once (interpret)."""
  args = make_inputs(shape, dtype)
  if impl == CPU_FUSED:
    q, k_cache, v_cache, *rest = args
    args = (q, k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2), *rest)  # head-major
    xla = jax.jit(functools.partial(tree_attention_reference, cache_layout=common.HEAD_MAJOR))
    kernel = jax.jit(functools.partial(ops.tree_attention, impl="xla",
                                       cache_layout=common.HEAD_MAJOR))
  else:
    xla = jax.jit(tree_attention_reference)
    kernel = jax.jit(functools.partial(ops.tree_attention, impl=impl, interpret=on_cpu))
  timed = impl == CPU_FUSED or not on_cpu
  expected = jax.block_until_ready(xla(*args))
  out = jax.block_until_ready(kernel(*args))  # Compiles (and checks) the kernel.
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
  xla_ms, kernel_ms = [], []
  for _ in range(reps):
    xla_ms.append(_time_ms(xla, args))
    if timed:
      kernel_ms.append(_time_ms(kernel, args))
  return (statistics.median(xla_ms), statistics.median(kernel_ms) if kernel_ms else None,
          err)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=30, help="timed runs per path")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--impl", default="auto", choices=ops.IMPLS,
                      help="kernel to compare with XLA (auto: the backend's)")
  parser.add_argument("--shapes", default="", help="comma-separated shape names")
  args = parser.parse_args(argv)

  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  impl = ops.resolve_impl(args.impl)
  shapes = CPU_SHAPES if on_cpu else DEVICE_SHAPES
  if args.shapes:
    wanted = set(args.shapes.split(","))
    shapes = tuple(s for s in shapes if s.name in wanted)
  dtype = jnp.dtype(args.dtype)
  runs = [(shape, impl) for shape in shapes]
  if on_cpu:
    pallas = ["pallas_tpu", "pallas_gpu"] if args.impl == "auto" else [impl]
    runs = [(shape, name) for shape in shapes for name in pallas if name != "xla"]
    if args.impl in ("auto", "xla") and ops.cpu_kernel_runs(1, 64, dtype, common.HEAD_MAJOR):
      fused = CPU_FUSED_SHAPES
      if args.shapes:
        fused = tuple(s for s in fused if s.name in set(args.shapes.split(",")))
      runs += [(shape, CPU_FUSED) for shape in fused]
    print("CPU backend: Pallas kernels run in interpret mode for correctness only (XLA "
          f"timed beside them); {CPU_FUSED} is the CPU's FFI kernel, timed.")
  print(f"backend={backend} ({jax.devices()[0].device_kind}) dtype={dtype.name} "
        f"reps={args.reps} (median of alternating runs)")
  header = (f"{'shape':20s} {'B':>3s} {'T':>4s} {'S':>6s} {'Hq/Hkv':>7s} {'hd':>4s} "
            f"{'impl':>11s} {'xla ms':>9s} {'kernel ms':>10s} {'speedup':>8s} "
            f"{'max err':>9s}")
  print(header)
  print("-" * len(header))
  for shape, kernel_impl in runs:
    xla_ms, kernel_ms, err = bench_shape(shape, dtype, kernel_impl, args.reps, on_cpu)
    kernel_col = "interpret" if kernel_ms is None else f"{kernel_ms:.3f}"
    speed_col = "-" if kernel_ms is None else f"{xla_ms / kernel_ms:.2f}x"
    print(f"{shape.name:20s} {shape.batch:3d} {shape.num_tree:4d} "
          f"{shape.cache_size:6d} {shape.num_q_heads:3d}/{shape.num_kv_heads:<3d} "
          f"{shape.head_dim:4d} {kernel_impl:>11s} {xla_ms:9.3f} {kernel_col:>10s} "
          f"{speed_col:>8s} {err:9.2e}", flush=True)

if __name__ == "__main__":
  main()
