#!/usr/bin/env bash
# The serving comparison on one GPU (11B shape, dummy bf16 weights), every variant back to back:
#   workload 1: 96 requests at concurrency 32, prompts of 200 words +-50%, half with a 4-tile
#               image (1120 px), 64 output tokens;
#   workload 2: 64 requests at concurrency 16, prompts of ~2k-16k tokens, half with a 4-tile
#               image, 128 output tokens;
#   the request-rate sweep of workload 1 (1, 2, 4, 8, 16 req/s and unbounded; SWEEP_PROMPTS
#               requests per rate) on the default server, with its PNG;
#   the token budget (--max-num-batched-tokens 256, 1024, 2048 next to the default) on workload 1,
#               and 2048 on workload 2.
# Servers: prefill-first (--no-enable-chunked-prefill) and chunked (the defaults), both with
# --max-model-len 16896 for workload 2, and one per extra budget. Writes, under $OUT, each run's
# JSON and /metrics, the sweep's JSON + PNG, and serving_summary.{json,md} (the table).
# Usage (repository root, offline GPU machine): bash tools/gpu_serving.sh [extra server args...]
# Env: ONLY (space-separated variant names to run: prefill_first chunked budget256 budget1024
# budget2048; unset: all of them, "" none), VARIANTS (below), SWEEP_RATES ("1 2 4 8 16 inf"),
# SWEEP_PROMPTS (48), TRACE=1 (servers under `python -m benchmarks.profiling serve`, a step
# trace per server), MODEL (demo/mllama-11b) and NUM_PROMPTS (96; workload 2 takes 2/3 of it)
# for a dry run on a small model.
set -uo pipefail
source tools/gpu_env.sh || exit 1
PORT=${PORT:-8321}
MODEL=${MODEL:-demo/mllama-11b}
N1=${NUM_PROMPTS:-96}
N2=$(( N1 * 2 / 3 ))
ONLY=${ONLY-prefill_first chunked budget256 budget1024 budget2048}
SWEEP_RATES=${SWEEP_RATES:-1 2 4 8 16 inf}
LEN="--max-model-len 16896"
W1=(--num-prompts "$N1" --max-concurrency 32 --input-len 200 --random-range-ratio 0.5
    --output-len 64 --image-ratio 0.5 --image-size 1120)
# ~1.3 tokens a word: 6,900 words +-77% is about 2k-16k tokens.
W2=(--num-prompts "$N2" --max-concurrency 16 --input-len 6900 --random-range-ratio 0.77
    --output-len 128 --image-ratio 0.5 --image-size 1120)
source tools/serving_lib.sh

wanted() { [[ " $ONLY " == *" $1 "* ]]; }
t0=$SECONDS
if wanted prefill_first && start_server prefill_first $LEN --no-enable-chunked-prefill "$@"; then
  bench w1_prefill_first "${W1[@]}"
  bench w2_prefill_first "${W2[@]}"
  stop_server
fi
if wanted chunked && start_server chunked $LEN "$@"; then
  bench w1_chunked "${W1[@]}"
  bench w2_chunked "${W2[@]}"
  read -r -a rates <<<"$SWEEP_RATES"
  # The sweep: workload 1 without the concurrency cap, SWEEP_PROMPTS requests per rate, on
  # seeds of its own (100 + i for the i-th rate): with prefix caching on, prompts that w1 or an
  # earlier rate already sent would be answered from the cache.
  python3 benchmarks/benchmark_serving.py --port "$PORT" "${COMMON[@]}" "${W1[@]}" --seed 100 \
    --num-prompts "${SWEEP_PROMPTS:-48}" --max-concurrency 1000000 --request-rate "${rates[@]}" \
    --result-dir "$OUT" --result-filename w1_sweep.json 2>&1 | tail -9
  stop_server
fi
for budget in 256 1024 2048; do
  if wanted "budget$budget" && start_server "budget$budget" $LEN --max-num-batched-tokens "$budget" "$@"; then
    bench "w1_budget$budget" "${W1[@]}"
    # Long prompts are where a larger budget could pay: workload 2 at the largest one too.
    [ "$budget" = 2048 ] && bench "w2_budget$budget" "${W2[@]}"
    stop_server
  fi
done
# VARIANTS="name:[NAME=VALUE...] server args;...": extra servers (environment first) on
# workload 1, and on workload 2 too for the names in W2_VARIANTS (space-separated).
IFS=';' read -r -a extra <<<"${VARIANTS:-}"
for v in "${extra[@]}"; do
  name=${v%%:*}; read -r -a vargs <<<"${v#*:}"
  if start_server "$name" "${vargs[@]}" $LEN "$@"; then
    bench "w1_$name" "${W1[@]}"
    [[ " ${W2_VARIANTS:-} " == *" $name "* ]] && bench "w2_$name" "${W2[@]}"
    stop_server
  fi
done
echo "all variants in $(( SECONDS - t0 )) s"
python3 tools/serving_table.py "$OUT"
