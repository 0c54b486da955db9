#!/usr/bin/env bash
# The router's selective threshold, measured: the local fleet (`fleetserve up`) under one mixed
# workload (random prompts of 40-1560 tokens, 32 out, concurrency 4, streamed) with
# `--disaggregation selective --min-uncached-tokens T` for each T, then decode-only (`never`):
# TTFT, TPOT, ITL p99 and the router's decisions side by side. Runs one fleet at a time.
#   hack/bench-selective-threshold.sh [MODEL_DIR]   (THRESHOLDS="16 256 1024", NUM_PROMPTS=20,
#                                                    INPUT_LEN=800, PY=python)
# Results: bench-results/threshold-*.{json,txt,log,decisions}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${1:-$($PY -c "from fleetserve.engine.models.bundled import bundled_model_path as p; print(p())")}
OUT=bench-results; mkdir -p "$OUT"
RUNS=()
for t in ${THRESHOLDS:-16 256 1024}; do RUNS+=("selective-$t"); done
RUNS+=("never-0")
for run in "${RUNS[@]}"; do
  mode=${run%-*}; t=${run#*-}
  log=$OUT/threshold-$run.log
  $PY -m fleetserve up --port 8300 --served-model-name bench --disaggregation "$mode" \
    --min-uncached-tokens "$t" --startup-timeout 600 \
    --engine-args "--dtype float32 --max-model-len 2048" > "$log" 2>&1 &
  pid=$!
  trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
  for _ in $(seq 1 600); do
    grep -q '^\[up\] ready' "$log" && break
    kill -0 $pid 2>/dev/null || { echo "fleetserve up exited; see $log" >&2; tail -5 "$log" >&2; exit 1; }
    sleep 1
  done
  $PY -m fleetserve bench serve --base-url http://127.0.0.1:8300 --model bench --tokenizer "$MODEL" \
    --dataset random --num-prompts "${NUM_PROMPTS:-20}" --input-len "${INPUT_LEN:-800}" \
    --random-range-ratio 0.95 --output-len 32 --max-concurrency 4 --ignore-eos --seed 0 \
    --percentiles 50,99 --output-json "$OUT/threshold-$run.json" > "$OUT/threshold-$run.txt"
  curl -s http://127.0.0.1:8300/metrics | grep '^fleetserve:router_decisions_total' \
    > "$OUT/threshold-$run.decisions" || true
  kill -INT $pid; wait $pid || true
  trap - EXIT
done
$PY - "$OUT" "${RUNS[@]}" <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
print(f"{'run':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT med':>10}{'ITL p99':>10}  decisions (one is the router's own readiness check)")
for run in runs:
    s = json.load(open(f"{out}/threshold-{run}.json"))["summary"]["stats_ms"]
    decisions = open(f"{out}/threshold-{run}.decisions").read().strip()
    decisions = decisions.replace("fleetserve:router_decisions_total", "").replace("\n", "; ")
    name = run.replace("-", " ") if not run.startswith("never") else "never (decode only)"
    print(f"{name:<18}{s['ttft']['p50']:>10.0f}{s['ttft']['p99']:>10.0f}{s['tpot']['median']:>10.1f}"
          f"{s['itl']['p99']:>10.0f}  {decisions}")
PY
