#!/usr/bin/env bash
# GPU check (issue 4, acceptance 4): on a CUDA machine (sized for one H200), run the kernel and
# engine test suites compiled on the GPU -- the @pytest.mark.gpu tests at realistic sizes plus
# the small tests, which use the GPU when there is one -- then the kernel benchmark (GB/s and
# TFLOP/s against the measured roofline) and the end-to-end decode benchmark (a
# Llama-3.1-8B-shaped random-weight model at batch 1, CUDA graphs and eager, against the
# weight-read roofline), and print one summary. Takes a few minutes, well under 10 (the parts
# are capped at 240 + 200 + 120 s); exits non-zero if a test or a benchmark fails.
#
# Usage: fleetserve/bench/gpu_check.sh [OUT_DIR]     (default: gpu_check/ in the cwd)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
OUT_DIR="${1:-gpu_check}"
mkdir -p "$OUT_DIR"
# Compiled kernels, not the CPU interpreter.
unset TRITON_INTERPRET

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
  exit 2
fi

# All kernel, attention-layer and worker tests: compiled kernels at their small sizes, the Triton
# backend against torch, padded decode batches, and every GPU-marked test (they all live in these
# three folders, and none of them needs the server's packages, which the device image lacks).
tests_rc=0
timeout 240 "$PY" -m pytest tests/kernels tests/engine/layers tests/engine/worker -q \
  -p no:cacheprovider -rfE >"$OUT_DIR/tests.log" 2>&1 || tests_rc=$?
kernels_rc=0
timeout 200 "$PY" -m fleetserve.kernels.bench --json "$OUT_DIR/kernels.json" \
  >"$OUT_DIR/kernels.txt" 2>&1 || kernels_rc=$?
decode_rc=0
timeout 120 "$PY" -m fleetserve.bench.decode --shape llama-3.1-8b --batch-size 1 \
  --json "$OUT_DIR/decode.json" >"$OUT_DIR/decode.txt" 2>"$OUT_DIR/decode.log" || decode_rc=$?

echo "== tests on GPU (rc=$tests_rc): $(grep -E '(passed|failed|error)' "$OUT_DIR/tests.log" | tr '\n' ' ')"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/tests.log" || true
echo "== kernel benchmark (rc=$kernels_rc, rows also in $OUT_DIR/kernels.json)"
cat "$OUT_DIR/kernels.txt"
echo "== decode benchmark (rc=$decode_rc, rows also in $OUT_DIR/decode.json)"
cat "$OUT_DIR/decode.txt"
[[ $decode_rc -eq 0 ]] || tail -n 20 "$OUT_DIR/decode.log"
[[ $tests_rc -eq 0 && $kernels_rc -eq 0 && $decode_rc -eq 0 ]]
