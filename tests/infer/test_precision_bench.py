"""infer.precision_bench: the weight-layout A/B runs both layouts and reports them."""

import pytest

from dart_jax.models import precision
from infer import precision_bench


@pytest.mark.skipif(not precision.panel_weights_active(),
                    reason="needs the CPU kernel's panel form (no AMX)")
def test_layout_ab_times_panels_and_rows(monkeypatch):
  monkeypatch.setattr(precision_bench, "AR_PROMPTS", ("Hi",))
  ab = precision_bench.layout_ab(1, rounds=1, sizes=(1, 2))
  runs = ab["fast"]
  assert set(runs) == {"panels", "rows"}
  for got in runs.values():
    assert set(got["verify_ms"]) == {1, 2} and all(v > 0 for v in got["verify_ms"].values())
    assert got["ar_tokens_per_s"] > 0
  report = precision_bench.kernel_report(ab, "weights as panels / rows")
  assert report.startswith("weights as panels / rows") and "panels" in report
