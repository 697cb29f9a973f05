#!/usr/bin/env bash
# Before/after measurements on one GPU, alternating: the H200 report and the serving benchmark
# of this tree against an older tree checked out at $BEFORE (a git worktree carried along), plus
# GPU tests. Each task runs only while the call's time budget allows it; all outputs are packed
# into $OUT/ab_$TAG.tgz and a table is printed last (also $OUT/table.txt).
# Usage (repository root, offline GPU machine, .whl/ and .cache/demo/ carried):
#   BEFORE=.before TASKS="tests report:before report:after serve:before serve:after" \
#     BUDGET_S=540 TAG=call1 bash tools/gpu_ab.sh
# Env: TESTS (pytest paths for the "tests" task), REPORT_ARGS (default "--skip-hf --batches 1,64").
set -uo pipefail
source tools/gpu_env.sh || exit 1
# Everything goes to one folder, packed at the end (a call brings back only a few files).
FINAL=$OUT OUT=$OUT/run
mkdir -p "$OUT"
ROOT=$PWD
BEFORE=${BEFORE:-.before}
BUDGET_S=${BUDGET_S:-540}
TAG=${TAG:-ab}
REPORT_ARGS=${REPORT_ARGS:---skip-hf --batches 1,64}
TESTS=${TESTS:-tests/kernels/test_large_offsets.py}
[ -e "$BEFORE/.cache" ] || ln -s "$ROOT/.cache" "$BEFORE/.cache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
declare -A EST=([tests]=200 [report]=110 [serve]=100)
n=0
for task in $TASKS; do
  kind=${task%%:*} side=${task#*:}
  if (( SECONDS + ${EST[$kind]:-120} > BUDGET_S )); then
    echo "skipped $task (t=${SECONDS}s)" | tee -a "$OUT/skipped.txt"; continue
  fi
  n=$((n + 1)); name="${n}_${kind}_${side}"; t0=$SECONDS
  case $kind in
    tests)
      timeout $((BUDGET_S - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rs $TESTS \
        >"$OUT/$name.log" 2>&1; tail -3 "$OUT/$name.log" ;;
    report)
      if [ "$side" = before ]; then
        (cd "$BEFORE" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/run_report.py \
          $REPORT_ARGS --out "$OUT/$name") >"$OUT/$name.log" 2>&1
      else
        python3 -m benchmarks.engine report $REPORT_ARGS --out "$OUT/$name" >"$OUT/$name.log" 2>&1
      fi
      tail -2 "$OUT/$name.log" ;;
    serve)
      if [ "$side" = before ]; then
        (cd "$BEFORE" && OUT=$OUT TAG=$name bash tools/gpu_serving.sh) >"$OUT/$name.log" 2>&1
      else
        TAG=$name bash tools/gpu_serving.sh >"$OUT/$name.log" 2>&1
      fi
      grep -E "Output token throughput|Median ITL|P99 ITL" "$OUT/$name.log" ;;
  esac
  echo "$name: $((SECONDS - t0)) s" | tee -a "$OUT/durations.txt"
done
python3 tools/ab_table.py "$OUT" | tee "$FINAL/table.txt"
tar czf "$FINAL/ab_$TAG.tgz" -C "$OUT" . && rm -rf "$OUT"
