"""Results of ``python -m infer.bench`` from its per-prompt JSON rows.

Per-method summaries of a (dataset, temperature) run, the greedy losslessness
check, the table printed on stdout and the ``--plot`` bar chart. Everything here
reads the JSON documents the harness (``infer.bench``) writes, never its run
records.
"""

import statistics
from typing import Sequence

from dart_jax.errors import InputError
from infer.bench_options import LOSSLESS_METHODS, METHODS

# The phases a ``--profile`` run splits each round into (the keys of
# ``dart_jax.generate``'s ``stats.phase_s``).
PHASES = ("search", "verify", "accept", "draft")


def rate(tokens: int, seconds: float) -> float | None:
  """tokens / seconds, or None when either is 0."""
  return tokens / seconds if tokens > 0 and seconds > 0 else None


def _median(values: list[float | None]) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def summarize(rows: list[dict], methods: Sequence[str], temperature: float) -> dict:
  """Per-method aggregates of per-prompt rows (see ``infer.bench``'s docstring)."""
  summary = {}
  ar_rows = [r["methods"]["ar"] for r in rows] if "ar" in methods else None
  for name in methods:
    recs = [r["methods"][name] for r in rows]
    decode_tokens = sum(r["decode_tokens"] for r in recs)
    decode_s = sum(r["decode_s"] for r in recs)
    rounds = sum(r["rounds"] for r in recs)
    s = {
        "prompts": len(recs),
        "new_tokens": sum(r["new_tokens"] for r in recs),
        "decode_tokens": decode_tokens, "decode_s": decode_s,
        "tokens_per_s": rate(decode_tokens, decode_s),
        "tokens_per_s_median": _median([r["tokens_per_s"] for r in recs]),
        "mean_accept_len": (sum(r["accept_len"] * r["rounds"] for r in recs) / rounds
                            if rounds else None),
        "ms_per_round": decode_s * 1e3 / rounds if rounds else None,
    }
    if ar_rows is not None and name != "ar":
      ar_tokens = sum(r["decode_tokens"] for r in ar_rows)
      ar_s = sum(r["decode_s"] for r in ar_rows)
      s["speedup_vs_ar"] = ((ar_s / ar_tokens) / (decode_s / decode_tokens)
                            if ar_tokens and decode_tokens and decode_s > 0 else None)
      s["speedup_vs_ar_median"] = _median([r["speedup_vs_ar"] for r in recs])
      s["matches_ar"] = sum(bool(r["matches_ar"]) for r in recs)
      s["compared"] = len(recs)
    summary[name] = s
  if "hf" in summary and "ar" in summary:
    hf, ar = summary["hf"], summary["ar"]
    summary["hf"]["ar_over_hf"] = (ar["tokens_per_s"] / hf["tokens_per_s"]
                                   if ar["tokens_per_s"] and hf["tokens_per_s"] else None)
    summary["hf"]["ar_over_hf_median"] = _median([
        a["tokens_per_s"] / h["tokens_per_s"]
        if a["tokens_per_s"] and h["tokens_per_s"] else None
        for a, h in zip(ar_rows, [r["methods"]["hf"] for r in rows])])
  profiled = [m for m in methods if any(m in r.get("profile", {}) for r in rows)]
  if profiled:
    summary["profile"] = {}
  for name in profiled:
    profiles = [r["profile"][name] for r in rows if name in r.get("profile", {})]
    rounds = sum(p["rounds"] for p in profiles)
    phases = {k: sum(p["phase_s"].get(k, 0.0) for p in profiles) * 1e3 / max(rounds, 1)
              for k in PHASES}
    summary["profile"][name] = {
        "prompts": len(profiles), "rounds": rounds, "phase_ms_per_round": phases,
        "phased_round_ms": sum(phases.values()),
        "ar_ms_per_step": summary.get("ar", {}).get("ms_per_round"),
        "matches_ar": sum(bool(p.get("matches_ar")) for p in profiles),
        **_round_costs(phases["verify"], summary.get(name, {}).get("ms_per_round"),
                       summary.get("ar", {}).get("ms_per_round")),
    }
  summary["greedy"] = temperature <= 0
  return summary


def _round_costs(verify_ms: float, fused_round_ms: float | None,
                 ar_step_ms: float | None) -> dict:
  """What a round costs beyond its verify pass, against an AR step.

  The phases are compiled one by one in the profile mode; normal decoding runs
  the round as one program, where search, accept and draft overlap and share
  one dispatch. So the round's own overhead is the fused round's ms minus the
  verify phase's (noisy: two runs; it can come out slightly negative).
  """
  out = {"fused_round_ms": fused_round_ms, "fused_overhead_ms": None,
         "verify_over_ar_step": None, "fused_overhead_over_ar_step": None}
  if fused_round_ms is not None:
    out["fused_overhead_ms"] = fused_round_ms - verify_ms
  if ar_step_ms:
    out["verify_over_ar_step"] = verify_ms / ar_step_ms
    if out["fused_overhead_ms"] is not None:
      out["fused_overhead_over_ar_step"] = out["fused_overhead_ms"] / ar_step_ms
  return out


def greedy_mismatches(runs: list[dict], strict_methods: Sequence[str] = LOSSLESS_METHODS
                      ) -> list[dict]:
  """Prompts where a strict (lossless speculative) method's T=0 output differs
  from AR's. ``hf`` is not strict (torch sums floats in another order)."""
  bad = []
  for run in runs:
    if run["temperature"] > 0:
      continue
    for row in run["prompts"]:
      checks = {m: rec.get("matches_ar") for m, rec in row["methods"].items()
                if m in strict_methods}
      for m, prof in row.get("profile", {}).items():
        checks[f"{m}(profile)"] = prof.get("matches_ar")
      for m, ok in checks.items():
        if ok is False:
          bad.append({"dataset": run["dataset"], "id": row["id"], "turn": row["turn"],
                      "method": m})
  return bad


# ----------------------------------------------------------------------------
# Stdout table and plot.
# ----------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
  return none if value is None else format(value, spec)


def format_table(runs: list[dict]) -> str:
  """A readable summary table of every (dataset, temperature) run."""
  lines = []
  head = (f"{'dataset':<10} {'T':>4} {'method':<14} {'prompts':>7} {'tok/s':>8} "
          f"{'tok/s med':>9} {'speedup':>8} {'spd med':>8} {'acc len':>8} {'greedy=AR':>10}")
  lines += [head, "-" * len(head)]
  for run in runs:
    s = run["summary"]
    for name, m in s.items():
      if name in ("greedy", "profile"):
        continue
      match = (f"{m['matches_ar']}/{m['compared']}" if "matches_ar" in m and s["greedy"]
               else "")
      lines.append(
          f"{run['dataset']:<10} {run['temperature']:>4g} {name:<14} {m['prompts']:>7} "
          f"{_fmt(m['tokens_per_s'], '.1f'):>8} {_fmt(m['tokens_per_s_median'], '.1f'):>9} "
          f"{_fmt(m.get('speedup_vs_ar'), '.2f') + ('x' if m.get('speedup_vs_ar') else ''):>8} "
          f"{_fmt(m.get('speedup_vs_ar_median'), '.2f'):>8} "
          f"{_fmt(m['mean_accept_len'], '.2f'):>8} {match:>10}")
    if "hf" in s and s["hf"].get("ar_over_hf") is not None:
      lines.append(f"{'':<24} ours (ar) / hf tokens/s: {s['hf']['ar_over_hf']:.2f}x "
                   f"(median per prompt {_fmt(s['hf']['ar_over_hf_median'])}x)")
    for name, prof in s.get("profile", {}).items():
      ph = prof["phase_ms_per_round"]
      lines.append(
          f"{'':<24} {name} ms/round: search {ph['search']:.1f}, verify {ph['verify']:.1f}, "
          f"accept {ph['accept']:.1f}, draft {ph['draft']:.1f} "
          f"(sum {prof['phased_round_ms']:.1f}); "
          f"ar ms/step {_fmt(prof['ar_ms_per_step'], '.1f')}; "
          f"verify / ar step {_fmt(prof['verify_over_ar_step'])}; fused round "
          f"{_fmt(prof['fused_round_ms'], '.1f')} = verify + "
          f"{_fmt(prof['fused_overhead_ms'], '.1f')} "
          f"({_fmt(prof['fused_overhead_over_ar_step'], '.0%')} of an ar step)")
  return "\n".join(lines)


def write_plot(runs: list[dict], path: str) -> None:
  """Bar chart: speedup vs AR and acceptance length per dataset/temperature/method."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise InputError("--plot needs matplotlib: pip install matplotlib "
                     "(or pip install -e '.[bench]')") from e
  groups = [f"{r['dataset']}\nT={r['temperature']:g}" for r in runs]
  methods = [m for m in METHODS if any(m in r["summary"] for r in runs)]
  fig, axes = plt.subplots(
      1, 2, figsize=(max(7, len(groups) * (1 + 0.4 * len(methods)) + 3), 4.5))
  width = 0.8 / max(len(methods), 1)
  for ax, key, title in ((axes[0], "speedup_vs_ar", "speedup vs AR (aggregate)"),
                         (axes[1], "mean_accept_len", "mean acceptance length")):
    for j, m in enumerate(methods):
      values = []
      for r in runs:
        s = r["summary"].get(m, {})
        v = 1.0 if (m == "ar" and key == "speedup_vs_ar") else s.get(key)
        values.append(v or 0.0)
      xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(runs))]
      bars = ax.bar(xs, values, width, label=m)
      ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90 if len(methods) > 4 else 0)
    ax.set_xticks(range(len(runs)), groups)
    ax.set_title(title)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
  # Below the axes: with many methods a legend inside would cover bars.
  handles, labels = axes[0].get_legend_handles_labels()
  ncol = min(len(methods), 4)
  legend_rows = -(-len(methods) // ncol)
  fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
  fig.tight_layout(rect=(0, 0.07 * legend_rows, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)
