#!/usr/bin/env bash
# GPU check for the Triton kernels (issue 4, acceptance 4): on a CUDA machine (sized for one
# H200), run the kernel test suite compiled on the GPU -- the @pytest.mark.gpu tests at realistic
# sizes plus the small tests, which use the GPU when there is one -- then the kernel benchmark,
# and print one summary: the test tally above the benchmark table. Takes a few minutes, well
# under 10 (each half is capped at 5); exits non-zero if a test fails or the benchmark does.
#
# Usage: fleetserve/bench/gpu_check.sh [JSON_OUT]     (default: gpu_check.json in the cwd)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
JSON_OUT="${1:-gpu_check.json}"
# Compiled kernels, not the CPU interpreter.
unset TRITON_INTERPRET

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
  exit 2
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
tests_rc=0
timeout 300 "$PY" -m pytest tests/kernels -q -p no:cacheprovider -rfE \
  >"$log" 2>&1 || tests_rc=$?
bench_rc=0
table="$(timeout 300 "$PY" -m fleetserve.kernels.bench --json "$JSON_OUT" 2>&1)" || bench_rc=$?

echo "== kernel tests on GPU (rc=$tests_rc): $(tail -n 1 "$log")"
grep -E '^(FAILED|ERROR)' "$log" || true
echo "== kernel benchmark (rc=$bench_rc, rows also in $JSON_OUT)"
echo "$table"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
