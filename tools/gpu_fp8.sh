#!/usr/bin/env bash
# FP8 weights on one GPU: the FP8 kernel and loading tests on CUDA, the FP8 GEMM sweep of the
# 11B text-layer shapes (writes the tuned table for this GPU model; bf16, scratch + cuBLAS and
# torch._scaled_mm beside it, decode to prefill sizes), the engine comparison with bf16 (decode
# per batch, linears, TTFT, replayed steps), and --quantization fp8 on a bf16 11B folder (load
# time and peak GPU memory; the folder is written once, 21 GB, under $FP8_FOLDER).
# Usage (repository root, offline GPU machine): bash tools/gpu_fp8.sh [kernels|engine|load|all]
# compressed-tensors (the tests' checkpoint writer) comes with the wheels of fetch_wheels.sh.
set -uo pipefail
source tools/gpu_env.sh || exit 1
WHAT=${1:-all}
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
if [ "$WHAT" = kernels ] || [ "$WHAT" = all ]; then
  stamp "FP8 tests on CUDA"
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_large_offsets.py tests/model_executor/test_fp8_loading.py} \
    >"$OUT/fp8_tests.log" 2>&1
  tail -3 "$OUT/fp8_tests.log"
  stamp "FP8 GEMM sweep, 11B shapes"
  timeout "${SWEEP_S:-500}" python3 -m benchmarks.kernels fp8 --sweep --table --silu --jobs 14 \
    --json "$OUT/fp8_11b.json" >"$OUT/fp8_sweep.log" 2>&1
  tail -2 "$OUT/fp8_sweep.log"
  cp vllm/model_executor/layers/fp8_configs/*.json "$OUT/" 2>/dev/null
  python3 - "$OUT/fp8_11b.json" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
print(f"copy {rep['copy_gb_s']:.0f} GB/s, read {rep['read_gb_s']:.0f} GB/s")
print("shape       M  bf16 us  scratch us  GEMM us  best us (%read)  scaled_mm us   table")
nan = {"us": float("nan"), "pct_read": float("nan")}
for r in rep["fp8"]:
    best, gemm = r.get("fp8_best", nan), r.get("fp8", nan)
    choice = r.get("choice", "-")
    choice = choice if isinstance(choice, str) else "GEMM " + "/".join(str(v) for v in choice.values())
    print(f"{r['shape']:8s} {r['m']:5d} {r['bf16']['us']:8.1f} {r['scratch']['us']:10.1f} "
          f"{gemm['us']:8.1f} {best['us']:8.1f} ({best['pct_read']:5.1f}) "
          f"{r['scaled_mm']['us']:12.1f}   {choice}")
for t in rep["layer"]:
    print("layer", t)
PY
fi
if [ "$WHAT" = engine ] || [ "$WHAT" = all ]; then
  stamp "engine: bf16 against FP8 dummy weights, 11B"
  timeout "${ENGINE_S:-500}" python3 -m benchmarks.engine quant --steps "${STEPS:-30}" --formats bf16,fp8 --batches "${BATCHES:-1,2,4,8,16,64,256}" \
    --out "$OUT/quant_fp8_11b.json" >"$OUT/quant_fp8_11b.log" 2>&1
  tail -25 "$OUT/quant_fp8_11b.log"
fi
if [ "$WHAT" = load ] || [ "$WHAT" = all ]; then
  stamp "--quantization fp8 on a bf16 11B folder"
  timeout "${LOAD_S:-500}" python3 -m benchmarks.engine load --folder "${FP8_FOLDER:-/tmp/mllama-11b-bf16}" \
    --write --json "$OUT/fp8_load.json" 2>&1 | tail -3
fi
stamp done
