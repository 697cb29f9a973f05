#!/usr/bin/env bash
# Serving benchmark on one GPU (11B shape, dummy bf16 weights): starts `vllm serve`, runs the
# concurrency-32 workload with image arrivals, saves the result JSON and the server's /metrics.
# Usage (repository root, offline GPU machine): bash tools/gpu_serving.sh [extra server args...]
# Env: TAG (file names), BENCH_ARGS (extra benchmark flags, e.g. "--random-range-ratio 0.5"),
# TRACE=1 (server under `python -m benchmarks.profiling serve`, a step trace; analysis in
# $OUT/$TAG.analysis.txt);
# MODEL and NUM_PROMPTS (defaults demo/mllama-11b, 96) for a dry run on a small model.
set -uo pipefail
source tools/gpu_env.sh || exit 1
PORT=${PORT:-8321}
TAG=${TAG:-serving}
SERVER=(-m vllm.entrypoints.cli.main)
if [ "${TRACE:-0}" = 1 ]; then
  export STEP_TRACE="$OUT/$TAG.trace.json"
  SERVER=(-m benchmarks.profiling)
fi
python3 "${SERVER[@]}" serve "${MODEL:-demo/mllama-11b}" --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --max-num-seqs 64 --port "$PORT" "$@" >"$OUT/$TAG.server.log" 2>&1 &
SRV=$!
trap 'kill -TERM $SRV 2>/dev/null' EXIT  # never leave the server behind
python3 - "$PORT" <<'PY' || { tail -30 "$OUT/$TAG.server.log"; kill $SRV; exit 1; }
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(600):
    try:
        if httpx.get(url, timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
python3 benchmarks/benchmark_serving.py --port "$PORT" --num-prompts "${NUM_PROMPTS:-96}" \
  --max-concurrency 32 \
  --input-len 200 --output-len 64 --image-ratio 0.5 --image-size 1120 \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 ${BENCH_ARGS:-} \
  --save-result --save-detailed --result-dir "$OUT" --result-filename "$TAG.json" 2>&1 | tail -40
python3 -c "import httpx,sys; print(httpx.get(f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" "$PORT" \
  >"$OUT/$TAG.metrics.txt"
grep -E "^vllm:(cuda_graph_replays|eager_decode)" "$OUT/$TAG.metrics.txt"
kill -TERM $SRV; wait $SRV
if [ "${TRACE:-0}" = 1 ]; then
  python3 -m benchmarks.profiling analyze "$OUT/$TAG.json" "$STEP_TRACE" \
    >"$OUT/$TAG.analysis.txt" 2>&1
  head -4 "$OUT/$TAG.analysis.txt"
fi
