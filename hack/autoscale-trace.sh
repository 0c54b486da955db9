#!/usr/bin/env bash
# The autoscaler on simulated traces (simulated engines, simulated clock, the real policy):
# prints attainment and replica-seconds against the smallest static pool that reaches 95%, and
# writes the plots under docs/autoscaling/. Usage: hack/autoscale-trace.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/autoscaling}"
py="${PYTHON:-python}"
mkdir -p "$out"
run() {  # name, then trace_report flags
  local name="$1"; shift
  echo "== $name: $*"
  "$py" -m fleetserve.operator.autoscale.trace_report "$@" --plot "$out/$name.png" | tee "$out/$name.json"
}
# The issue's bursty trace: 1 ↔ 24 req/s of 8k-token prompts, a P:D band of 2..6.
run bursty-cold5 --trace bursty:low=1,high=24,low_s=420,high_s=180 --duration 1800 \
  --cold-start 5 --down 60 --ratio-min 2 --ratio-max 6
run bursty-cold15 --trace bursty:low=1,high=24,low_s=420,high_s=180 --duration 1800 \
  --cold-start 15 --down 60 --ratio-min 2 --ratio-max 6
run bursty-cold15-down300 --trace bursty:low=1,high=24,low_s=420,high_s=180 --duration 1800 \
  --cold-start 15 --down 300 --ratio-min 2 --ratio-max 6
run step --trace step:low=2,high=16,at=120,until=480 --duration 720 --cold-start 15 --down 60
run ramp --trace ramp:low=1,high=20,start=60,end=600 --duration 900 --cold-start 15 --down 60
run diurnal --trace diurnal:low=1,high=20,period=900 --duration 1800 --cold-start 15 --down 60
run spike --trace spike:low=2,high=24,at=300,width=60 --duration 720 --cold-start 15 --down 60
# Noisy steady load from a pool already sized for it (the flapping check, not a cold start).
run noisy-steady --trace steady:rate=8,noise=0.15 --duration 900 --cold-start 15 --down 300 \
  --initial-prefill 6 --initial-decode 1
