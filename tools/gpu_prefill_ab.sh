#!/usr/bin/env bash
# Prefill attention variants on one GPU under varied prompt lengths: the first-call cost of a
# new length per variant (benchmarks/kernels/benchmark_prefill_plans.py), then traced serving
# runs (tools/gpu_serving.sh, --random-range-ratio 0.5) alternating VLLM_PREFILL_ATTENTION,
# each analysed by stall and by first-seen prompt length. Prints a table last.
# Usage (repository root, offline GPU machine):
#   VARIANTS="sdpa sdpa_buckets" ROUNDS=2 RANGE=0.5 bash tools/gpu_prefill_ab.sh
# A variant is a VLLM_PREFILL_ATTENTION value or any VAR=VALUE for the server's environment
# (e.g. VARIANTS="sdpa CUDA_MODULE_LOADING=EAGER"); PLANS=0 skips the microbenchmark.
# (a CPU dry run of the plumbing: MODEL=demo/mllama-tiny NUM_PROMPTS=8 PLANS_ARGS=--smoke)
set -uo pipefail
source tools/gpu_env.sh || exit 1
VARIANTS=${VARIANTS:-sdpa sdpa_buckets}
ROUNDS=${ROUNDS:-2}
RANGE=${RANGE:-0.5}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${PLANS:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/kernels/benchmark_prefill_plans.py ${PLANS_ARGS:-} \
    --out "$OUT/prefill_plans.json" \
    >"$OUT/prefill_plans.log" 2>&1
  tail -22 "$OUT/prefill_plans.log"
fi
port=8400
for i in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    tag="range${RANGE}_${v//[^A-Za-z0-9_]/_}_$i"
    port=$((port + 1))
    case $v in *=*) setting=$v ;; *) setting=VLLM_PREFILL_ATTENTION=$v ;; esac
    env "$setting" PORT=$port TAG=$tag TRACE=1 BENCH_ARGS="--random-range-ratio $RANGE" \
      timeout 240 bash tools/gpu_serving.sh >"$OUT/$tag.out" 2>&1
    pkill -f -- "--port $port" 2>/dev/null  # a server a timed-out run left behind
    python3 benchmarks/analyze_serve_trace.py "$OUT/$tag.json" --by-length \
      >>"$OUT/$tag.analysis.txt" 2>&1
    grep -h "Warm-up" "$OUT/$tag.server.log" | tail -1 | cut -c1-150
  done
done
echo "variant / round: ITL median, p99 (ratio) | stalls around prefills by prompt length"
for f in "$OUT"/range*.analysis.txt; do
  echo "$(basename "$f" .analysis.txt): $(head -1 "$f" | cut -d: -f2-) |$(grep -h "first of its" "$f" \
    | cut -d: -f2)"
done
