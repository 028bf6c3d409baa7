"""Summaries, greedy check and table of the benchmark (infer.bench_report)."""

import pytest

from infer import bench_options, bench_report


def _row(ar_s, ar_tokens, dart_s, dart_tokens, rounds, accept, match=True):
  def rec(s, tokens, rounds_, acc):
    return {"new_tokens": tokens + 1, "decode_tokens": tokens, "decode_s": s,
            "tokens_per_s": tokens / s, "rounds": rounds_, "accept_len": acc}
  dart = rec(dart_s, dart_tokens, rounds, accept)
  dart["matches_ar"] = match
  dart["speedup_vs_ar"] = (ar_s / ar_tokens) / (dart_s / dart_tokens)
  return {"id": "x", "turn": 1, "methods": {"ar": rec(ar_s, ar_tokens, ar_tokens, 1.0),
                                           "dart": dart}}


def test_summarize_aggregates_by_hand():
  rows = [_row(1.0, 10, 0.5, 10, 4, 2.5), _row(3.0, 10, 1.0, 10, 5, 2.0, match=False),
          _row(2.0, 20, 2.0, 20, 10, 2.0)]
  s = bench_report.summarize(rows, ["ar", "dart"], temperature=0.0)
  assert s["ar"]["tokens_per_s"] == pytest.approx(40 / 6.0, rel=1e-12)
  assert s["ar"]["tokens_per_s_median"] == pytest.approx(10.0, rel=1e-12)
  assert s["dart"]["tokens_per_s"] == pytest.approx(40 / 3.5, rel=1e-12)
  # Per-prompt speedups 2, 3, 1 -> median 2; aggregate (6/40)/(3.5/40).
  assert s["dart"]["speedup_vs_ar_median"] == pytest.approx(2.0, rel=1e-12)
  assert s["dart"]["speedup_vs_ar"] == pytest.approx(6.0 / 3.5, rel=1e-12)
  # Acceptance weighted by rounds: (4*2.5 + 5*2 + 10*2) / 19.
  assert s["dart"]["mean_accept_len"] == pytest.approx(40 / 19, rel=1e-12)
  assert (s["dart"]["matches_ar"], s["dart"]["compared"]) == (2, 3)
  assert s["ar"]["ms_per_round"] == pytest.approx(6000 / 40, rel=1e-12)
  bad = bench_report.greedy_mismatches([
      {"dataset": "d", "temperature": 0.0, "prompts": rows},
      {"dataset": "d", "temperature": 1.0, "prompts": rows}])
  assert bad == [{"dataset": "d", "id": "x", "turn": 1, "method": "dart"}]


def test_summarize_profiles_every_method_by_hand():
  rows = [_row(1.0, 10, 0.5, 10, 4, 2.5), _row(3.0, 10, 1.0, 10, 5, 2.0)]
  for row in rows:
    row["methods"]["dartree"] = dict(row["methods"]["dart"])
  rows[0]["profile"] = {
      "dart": {"rounds": 4, "phase_s": {"search": 0.4, "verify": 0.8, "accept": 0.2,
                                        "draft": 0.2}, "matches_ar": True},
      "dartree": {"rounds": 2, "phase_s": {"search": 0.1, "verify": 0.2, "accept": 0.1,
                                           "draft": 0.1}, "matches_ar": False}}
  rows[1]["profile"] = {
      "dart": {"rounds": 6, "phase_s": {"search": 0.6, "verify": 1.2, "accept": 0.3,
                                        "draft": 0.4}, "matches_ar": True}}
  s = bench_report.summarize(rows, ["ar", "dart", "dartree"], temperature=0.0)
  assert list(s["profile"]) == ["dart", "dartree"]
  dart = s["profile"]["dart"]
  # 10 rounds: search 1.0 s, verify 2.0, accept 0.5, draft 0.6 -> ms per round.
  expected = {"search": 100.0, "verify": 200.0, "accept": 50.0, "draft": 60.0}
  assert dart["phase_ms_per_round"] == pytest.approx(expected, rel=1e-12)
  assert dart["phased_round_ms"] == pytest.approx(410.0, rel=1e-12)
  assert (dart["prompts"], dart["rounds"], dart["matches_ar"]) == (2, 10, 2)
  assert dart["ar_ms_per_step"] == s["ar"]["ms_per_round"]
  # The fused round (unprofiled) minus the profiled verify phase, against AR.
  fused = s["dart"]["ms_per_round"]
  assert dart["fused_round_ms"] == fused
  assert dart["fused_overhead_ms"] == pytest.approx(fused - 200.0, rel=1e-12)
  assert dart["verify_over_ar_step"] == pytest.approx(200.0 / s["ar"]["ms_per_round"])
  assert dart["fused_overhead_over_ar_step"] == pytest.approx(
      (fused - 200.0) / s["ar"]["ms_per_round"])
  tree = s["profile"]["dartree"]
  assert (tree["prompts"], tree["rounds"], tree["matches_ar"]) == (1, 2, 0)
  assert tree["phase_ms_per_round"]["verify"] == pytest.approx(100.0, rel=1e-12)
  bad = bench_report.greedy_mismatches([{"dataset": "d", "temperature": 0.0, "prompts": rows}])
  assert bad == [{"dataset": "d", "id": "x", "turn": 1, "method": "dartree(profile)"}]
  table = bench_report.format_table([{"dataset": "d", "temperature": 0.0, "summary": s}])
  assert "dart ms/round: search 100.0, verify 200.0, accept 50.0, draft 60.0 (sum 410.0)" in table
  assert "dartree ms/round: search 50.0, verify 100.0" in table


def test_greedy_mismatches_are_strict_for_every_speculative_method():
  methods = {m: {"matches_ar": False} for m in bench_options.LOSSLESS_METHODS + ("hf",)}
  methods["ar"] = {}
  row = {"id": "x", "turn": 2, "methods": methods}
  runs = [{"dataset": "d", "temperature": 0.0, "prompts": [row]},
          {"dataset": "d", "temperature": 1.0, "prompts": [row]}]
  bad = bench_report.greedy_mismatches(runs)
  assert [b["method"] for b in bad] == list(bench_options.LOSSLESS_METHODS)  # not hf, not T=1
  assert bad[0] == {"dataset": "d", "id": "x", "turn": 2, "method": "dart"}
