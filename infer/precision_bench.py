"""Benchmark: the matmul policy's dot forms, and the target's verify-cost curve per mode.

  python -m infer.precision_bench [--reps 15] [--json out.json] [--no-target]

1. Dots of the embedded model's shapes (tied LM head 576 x 49152, MLP up 576 x
   1536 and down 1536 x 576) at M rows: float32 weights with float32 dots, and
   bf16 weights with the ``split3`` (target, exact) and ``rows`` (drafter) forms
   of ``dart_jax.models.precision.matmul``, each in the layout its mode stores.
   Median ms of alternating runs.
2. One target pass over T tokens (a tree-verify pass, as ``--tree-budget auto``
   times it) in each mode, and its cost relative to T=1 of the same mode and of
   float32: the curve that decides how large a tree pays on this machine.
3. Plain decoding (AR) tokens/s of the embedded model in each mode, alternating
   runs on the same chat prompts.
4. ``--kernel-ab`` (CPUs where ``kernels.cpu_matmul`` runs): the verify curve and
   AR tokens/s of each mode with the CPU kernel on and off, alternating in one
   process (programs are traced again at each switch). "Off" is XLA's float32
   dot on the widened bf16 weights: on a CPU without a bf16 matrix unit (AMX)
   that is what ``matmul`` runs wherever the kernel does not (before session 15 it was
   the ``split3`` bf16 dot, 2-3x slower there). Likewise section 1's bf16 forms
   run through the kernel or widened weights on such a CPU.
5. ``--layout-ab``: the same for the ``fast`` mode's two weight layouts on a CPU
   where the kernel's panel form runs (``precision.weight_layout``): panels
   ``[out / 8, in, 8]`` against ``[out, in]`` rows, two targets in one process,
   alternating.
"""

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

import dart_jax as dj
from dart_jax.models import precision
from dart_jax import tree_budget
from kernels import timing

DOT_SHAPES = {"lm_head": (576, 49152), "mlp_up": (576, 1536), "mlp_down": (1536, 576)}
ROWS = (1, 2, 9, 16, 32, 64, 128, 512)
MODES = ("float32", "fast")


def dot_table(reps: int, rows=ROWS) -> dict:
  """{shape: {M: {form: median ms}}} for float32, split3 and rows."""
  forms = {"float32": precision.FLOAT32, "split3": precision.FAST,
           "rows": precision.FAST_ROWS}
  table = {}
  for name, (k, n) in DOT_SHAPES.items():
    w32 = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
    # Each form in the layout its mode stores (the fast modes: [out, in]).
    weights = {f: (w32.T if p.transposed_weights else w32).astype(p.weight_dtype)
               for f, p in forms.items()}
    table[name] = {}
    for m in rows:
      x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
      fns = {f: jax.jit(lambda a, w, p=p: precision.matmul(a, w, p,
                                                           transposed=p.transposed_weights))
             for f, p in forms.items()}
      times = {f: [] for f in forms}
      for rep in range(reps):  # alternate forms so drift hits all alike
        for f in (forms if rep % 2 == 0 else reversed(list(forms))):
          times[f] += timing.time_calls(fns[f], (x, weights[f]), 1)
      table[name][m] = {f: 1e3 * statistics.median(t) for f, t in times.items()}
  return table


def verify_curves(reps: int, sizes=tree_budget.VERIFY_SIZES) -> dict:
  """{mode: {T: median ms}} of a target tree-verify pass, embedded SmolLM2."""
  return {mode: {t: 1e3 * s for t, s in tree_budget.measure_verify_costs(
      dj.load_target(dtype=mode), sizes, reps=reps).items()} for mode in MODES}


AR_PROMPTS = ("Explain what a compiler does in three sentences.",
              "Write a Python function that reverses a linked list.")


def ar_rates(reps: int, max_new_tokens: int = 64) -> dict:
  """{mode: median AR tokens/s} on ``AR_PROMPTS``, modes alternating."""
  targets = {mode: dj.load_target(dtype=mode) for mode in MODES}
  rates = {mode: [] for mode in MODES}
  for rep in range(reps + 1):
    for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES))):
      for prompt in AR_PROMPTS:
        out = dj.generate(targets[mode], prompt, max_new_tokens=max_new_tokens,
                          eos_token_ids=())
        if rep:  # the first pass compiles
          rates[mode].append(out.stats.tokens_per_s)
  return {mode: statistics.median(r) for mode, r in rates.items()}


def _alternating_kernel_settings(rounds: int):
  """Yields "on" / "off" ``rounds`` times each (on, off, off, on, ...), with the CPU
  kernel switched accordingly while the caller's block runs; clear jit caches in
  the block so that programs are traced under the setting."""
  for rnd in range(rounds):
    for setting in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
      with precision.cpu_kernel(setting == "on"):
        yield setting


AB_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _curve_and_rate(target, sizes, reps: int) -> tuple[dict, float]:
  """(verify seconds per T, median AR tokens/s on ``AR_PROMPTS``) of one target."""
  curve = tree_budget.measure_verify_costs(target, sizes, reps=reps)
  rates = []
  for prompt in AR_PROMPTS:
    for timed in (False, True):  # the first run compiles
      out = dj.generate(target, prompt, max_new_tokens=64, eos_token_ids=())
      if timed:
        rates.append(out.stats.tokens_per_s)
  return curve, statistics.median(rates)


def _medians(runs: dict, sizes) -> dict:
  """{setting: [(curve, rate), ...]} -> {setting: {"verify_ms", "ar_tokens_per_s"}}."""
  return {setting: {
      "verify_ms": {t: 1e3 * statistics.median(c[t] for c, _ in got) for t in sizes},
      "ar_tokens_per_s": statistics.median(r for _, r in got)}
      for setting, got in runs.items()}


def kernel_ab(reps: int, rounds: int = 2, sizes=AB_SIZES, modes=MODES) -> dict:
  """{mode: {"on"|"off": {"verify_ms": {T: ms}, "ar_tokens_per_s": float}}}: the
  CPU kernel on and off, alternating ``rounds`` times; medians over rounds."""
  targets = {mode: dj.load_target(dtype=mode) for mode in modes}
  runs = {mode: {s: [] for s in ("on", "off")} for mode in modes}
  for setting in _alternating_kernel_settings(rounds):
    for mode, target in targets.items():
      jax.clear_caches()
      runs[mode][setting].append(_curve_and_rate(target, sizes, reps))
  return {mode: _medians(by_setting, sizes) for mode, by_setting in runs.items()}


def _layout_targets() -> dict:
  """The embedded model in the fast mode with each dense-weight layout."""
  targets = {"panels": dj.load_target(dtype="fast")}
  with precision.panel_weights(False):
    targets["rows"] = dj.load_target(dtype="fast")
  return targets


def _alternating_layouts(rounds: int):
  """Yields "panels" / "rows" ``rounds`` times each (panels, rows, rows, panels, ...)."""
  for rnd in range(rounds):
    yield from (("panels", "rows") if rnd % 2 == 0 else ("rows", "panels"))


def layout_ab(reps: int, rounds: int = 2, sizes=AB_SIZES) -> dict:
  """{"fast": {"panels"|"rows": {"verify_ms": {T: ms}, "ar_tokens_per_s": float}}}:
  the fast mode with its dense weights as panels and as ``[out, in]`` rows, two
  targets alternating ``rounds`` times in one process; medians over rounds."""
  targets = _layout_targets()
  runs = {layout: [] for layout in targets}
  for layout in _alternating_layouts(rounds):
    runs[layout].append(_curve_and_rate(targets[layout], sizes, reps))
  return {"fast": _medians(runs, sizes)}


def _batched_rate(target, batch: int, new_tokens: int) -> float:
  """New tokens/s of plain decoding of ``batch`` chat prompts, prefill included
  (as in regeneration); a short untimed run compiles first."""
  prompts = [f"Write a short note about topic number {i}: rivers, code, or music."
             for i in range(batch)]
  dj.generate(target, prompts, max_new_tokens=8, eos_token_ids=())
  out = dj.generate(target, prompts, max_new_tokens=new_tokens, eos_token_ids=())
  return sum(len(t) for t in out.tokens) / out.stats.total_s


def batched_ab(batch: int, new_tokens: int = 48, rounds: int = 2) -> dict:
  """{"on"|"off": median new tokens/s}: batched plain decoding in the default
  mode, the CPU kernel on and off alternating."""
  target = dj.load_target()
  rates = {"on": [], "off": []}
  for setting in _alternating_kernel_settings(rounds):
    jax.clear_caches()
    rates[setting].append(_batched_rate(target, batch, new_tokens))
  return {setting: statistics.median(r) for setting, r in rates.items()}


def batched_layout_ab(batch: int, new_tokens: int = 48, rounds: int = 2) -> dict:
  """{"panels"|"rows": median new tokens/s}: batched plain decoding in the fast
  mode with each weight layout, alternating."""
  targets = _layout_targets()
  rates = {layout: [] for layout in targets}
  for layout in _alternating_layouts(rounds):
    rates[layout].append(_batched_rate(targets[layout], batch, new_tokens))
  return {layout: statistics.median(r) for layout, r in rates.items()}


def kernel_report(ab: dict, title: str = "CPU kernel on/off") -> str:
  sizes = list(next(iter(next(iter(ab.values())).values()))["verify_ms"])
  lines = [f"{title}: target pass ms  T " + "  ".join(f"{t:>6}" for t in sizes)
           + "   AR tok/s"]
  for mode, by_setting in ab.items():
    for setting, got in by_setting.items():
      lines.append(f"  {mode:<8} {setting:<4}" + " " * 20 + "  ".join(
          f"{v:6.1f}" for v in got["verify_ms"].values())
                   + f"   {got['ar_tokens_per_s']:.1f}")
  return "\n".join(lines)


def report(dots: dict, curves: dict | None, ar: dict | None = None) -> str:
  lines = ["dot ms (median)      " + "".join(f"{'M=' + str(m):>22}" for m in ROWS)]
  for name, by_rows in dots.items():
    lines.append(f"{name:<20} " + "".join(
        f"{r['float32']:6.2f}/{r['split3']:6.2f}/{r['rows']:6.2f}  "
        for r in by_rows.values()))
  lines.append("  (float32 / split3 / rows)")
  if curves:
    base = curves["float32"][1]
    lines.append("target pass ms:  T  " + "  ".join(f"{t:>6}" for t in curves["float32"]))
    for mode, curve in curves.items():
      lines.append(f"  {mode:<15}  " + "  ".join(f"{v:6.1f}" for v in curve.values()))
      lines.append(f"  {'x own T=1':<15}  " + "  ".join(
          f"{v / curve[1]:6.2f}" for v in curve.values()))
      lines.append(f"  {'x float32 T=1':<15}  " + "  ".join(
          f"{v / base:6.2f}" for v in curve.values()))
  if ar:
    lines.append("AR tok/s: " + ", ".join(f"{m} {r:.1f}" for m, r in ar.items())
                 + f"  (fast / float32 = {ar['fast'] / ar['float32']:.3f})")
  return "\n".join(lines)


def _report_ab(ab: dict, key: str, title: str, batch: int, batched, json_path) -> int:
  """Prints an A/B's table (and ``batched(batch)``'s rates when ``batch``), writes
  it under ``key`` to ``json_path`` if given; returns the exit status."""
  print(kernel_report(ab, title))
  if batch:
    rates = batched(batch)
    ab["batched"] = {"batch": batch, **rates}
    print(f"batch {batch} plain decoding, new tokens/s: "
          + ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items()))
  if json_path:
    with open(json_path, "w") as f:
      json.dump({key: ab, "devices": [str(d) for d in jax.devices()]}, f, indent=1)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--reps", type=int, default=15, help="timed runs per entry (15)")
  p.add_argument("--json", default=None, help="write the numbers to this JSON file")
  p.add_argument("--no-target", action="store_true",
                 help="dots only (skip the embedded model's verify curves)")
  p.add_argument("--kernel-ab", action="store_true",
                 help="only the verify curves and AR rates with the CPU kernel on vs off")
  p.add_argument("--layout-ab", action="store_true",
                 help="only the fast mode's verify curve and AR rate with panel weights "
                      "vs [out, in] rows")
  p.add_argument("--batched-ab", type=int, default=0, metavar="B",
                 help="with --kernel-ab / --layout-ab: also plain decoding of B prompts "
                      "at once")
  p.add_argument("--modes", default=",".join(MODES),
                 help="with --kernel-ab: the modes to time (default: float32,fast)")
  args = p.parse_args(argv)
  if args.layout_ab:
    if not precision.panel_weights_active():
      p.error("--layout-ab: the kernel's panel form does not run here (needs the CPU "
              "kernel without AMX; DART_JAX_CPU_PANELS=0 turns it off)")
    return _report_ab(layout_ab(max(3, args.reps // 2)), "layout_ab",
                      "weights as panels / rows", args.batched_ab, batched_layout_ab,
                      args.json)
  if args.kernel_ab:
    if not precision.cpu_kernel_active():
      p.error("--kernel-ab: the CPU kernel does not run here (kernels.cpu_matmul)")
    return _report_ab(kernel_ab(max(3, args.reps // 2), modes=tuple(args.modes.split(","))),
                      "kernel_ab", "CPU kernel on/off", args.batched_ab, batched_ab, args.json)
  dots = dot_table(args.reps)
  curves = None if args.no_target else verify_curves(max(3, args.reps // 2))
  ar = None if args.no_target else ar_rates(max(2, args.reps // 5))
  print(report(dots, curves, ar))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"dots_ms": dots, "verify_ms": curves, "ar_tokens_per_s": ar,
                 "devices": [str(d) for d in jax.devices()]}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
