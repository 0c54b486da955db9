#!/usr/bin/env bash
# Long prompts through the local fleet (`fleetserve up`: prefill engine → decode engine behind
# the router, disaggregation always) against one colocated `fleetserve serve`, one after the
# other, with the same `fleetserve bench serve` workload (random prompts, 1536 in / 64 out,
# concurrency 4, streamed): TTFT, TPOT and ITL p99 side by side.
#   hack/bench-fleet-vs-colocated.sh [MODEL_DIR]   (CONNECTOR=mooncake, NUM_PROMPTS=32, INPUT_LEN,
#                                                   CONCURRENCY, ONLY=fleet|colocated, PY=python)
# Results: bench-results/fleet-{fleet,colocated}.{json,txt,log}. Needs `fleetserve router`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${1:-$($PY -c "from fleetserve.engine.models.bundled import bundled_model_path as p; print(p())")}
OUT=bench-results; mkdir -p "$OUT"
INPUT_LEN=${INPUT_LEN:-1536}
ENGINE=(--dtype float32 --max-model-len 2048)
BENCH=($PY -m fleetserve bench serve --model bench --tokenizer "$MODEL" --dataset random
       --num-prompts "${NUM_PROMPTS:-32}" --input-len "$INPUT_LEN" --output-len 64
       --max-concurrency "${CONCURRENCY:-4}" --ignore-eos --seed 0 --percentiles 50,99)

wait_for() {  # name pid ready-command: retry it for up to 600 s while the server lives
  local name=$1 pid=$2 ready=$3
  for _ in $(seq 1 600); do
    bash -c "$ready" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$name exited; see $OUT/fleet-$name.log:" >&2; tail -5 "$OUT/fleet-$name.log" >&2; return 1; }
    sleep 1
  done
  echo "$name did not come up in 600 s" >&2; return 1
}

run_one() {  # name url ready-command -- server command...
  local name=$1 url=$2 ready=$3; shift 4
  "$@" > "$OUT/fleet-$name.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill -INT $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null' EXIT
  wait_for "$name" "$SERVER_PID" "$ready"
  "${BENCH[@]}" --base-url "$url" --output-json "$OUT/fleet-$name.json" | tee "$OUT/fleet-$name.txt"
  kill -INT "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  trap - EXIT
}

ONLY=${ONLY:-both}  # fleet | colocated | both
# `fleetserve up` prints "[up] ready" once the router answered /health 200.
[ "$ONLY" = colocated ] || run_one fleet http://127.0.0.1:8200 "grep -q '^\[up\] ready' $OUT/fleet-fleet.log" -- \
  $PY -m fleetserve up --port 8200 --served-model-name bench --connector "${CONNECTOR:-tcp}" \
  --disaggregation always --startup-timeout 600 "${ENGINE[@]}"
[ "$ONLY" = fleet ] || run_one colocated http://127.0.0.1:8210 "curl -sf http://127.0.0.1:8210/health >/dev/null" -- \
  $PY -m fleetserve serve "$MODEL" --port 8210 --served-model-name bench "${ENGINE[@]}"

[ "$ONLY" = both ] || exit 0
$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/fleet-{name}.json"))["summary"] for name in ("fleet", "colocated")}
rows = [("TTFT p50 (ms)", "ttft", "p50"), ("TTFT p99 (ms)", "ttft", "p99"),
        ("TPOT median (ms)", "tpot", "median"), ("TPOT p99 (ms)", "tpot", "p99"),
        ("ITL p50 (ms)", "itl", "p50"), ("ITL p99 (ms)", "itl", "p99")]
print(f"{'':<22}{'fleet (P/D)':>14}{'colocated':>14}{'ratio':>8}")
for label, metric, stat in rows:
    a, b = (runs[n]["stats_ms"][metric][stat] for n in ("fleet", "colocated"))
    print(f"{label:<22}{a:>14.1f}{b:>14.1f}{a / b if b else float('nan'):>8.2f}")
for name in ("fleet", "colocated"):
    s = runs[name]
    print(f"{name}: {s['completed']} completed, {s['failed']} failed, {s['output_throughput']:.1f} tok/s out")
PY
