#!/usr/bin/env bash
# Tensor parallelism on a machine with N >= 2 GPUs (issue #36's runs): the two-GPU tests, the
# collectives of one decode step (benchmarks.kernels allreduce, 11B and 90B widths), then
# `vllm bench latency` at -tp 1 and -tp N on dummy weights (11B; 90B at -tp N only, when the
# GPUs hold it), whose per-token times go against the floor in benchmarks/RESULTS.md.
# Usage (repository root, offline GPU machine, .whl/ and .cache/demo/ present):
#   TP=2 bash tools/gpu_tp.sh [tests|collectives|latency|all]
set -uo pipefail
source tools/gpu_env.sh || exit 1
TP=${TP:-2}
WHAT=${1:-all}
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  stamp "two-GPU tests"
  timeout 500 python3 -m pytest -q -p no:cacheprovider -rs tests/distributed/test_tp_gpu.py \
    >"$OUT/tp_tests.log" 2>&1
  tail -5 "$OUT/tp_tests.log"
fi
if [ "$WHAT" = collectives ] || [ "$WHAT" = all ]; then
  for m in 11b 90b; do
    stamp "collectives, $m, tp $TP"
    timeout 300 python3 -m benchmarks.kernels allreduce --tp "$TP" --model $m \
      --batches 1,8,64 --json "$OUT/allreduce_$m.json" 2>&1 | tail -8
  done
fi
if [ "$WHAT" = latency ] || [ "$WHAT" = all ]; then
  for tp in 1 "$TP"; do
    stamp "latency, 11B, tp $tp"
    timeout 500 python3 -m vllm.entrypoints.cli.main bench latency --model demo/mllama-11b \
      --load-format dummy -tp "$tp" --batch-size 1 --input-len 128 --output-len 64 \
      --output-json "$OUT/latency_11b_tp$tp.json" >"$OUT/latency_11b_tp$tp.log" 2>&1
    tail -3 "$OUT/latency_11b_tp$tp.log"
  done
  stamp "latency, 90B, tp $TP"
  timeout 550 python3 -m vllm.entrypoints.cli.main bench latency --model demo/mllama-90b \
    --load-format dummy -tp "$TP" --batch-size 1 --input-len 128 --output-len 64 \
    --output-json "$OUT/latency_90b_tp$TP.json" >"$OUT/latency_90b_tp$TP.log" 2>&1
  tail -3 "$OUT/latency_90b_tp$TP.log"
fi
stamp end
