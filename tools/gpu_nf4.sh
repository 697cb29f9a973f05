#!/usr/bin/env bash
# bitsandbytes 4-bit on one GPU: the 4-bit kernel tests on CUDA (bitsandbytes as reference), the
# NF4 GEMM sweep of the 11B text-layer shapes (writes the tuned table for this GPU model), then
# the engine comparison with bf16 (decode per batch, linears, TTFT, replayed steps).
# Usage (repository root, offline GPU machine): bash tools/gpu_nf4.sh [kernels|engine|90b|all]
# bitsandbytes itself: a directory holding the package on EXTRA_PYTHONPATH (its CUDA 13 library).
set -uo pipefail
source tools/gpu_env.sh || exit 1
WHAT=${1:-all}
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
if [ "$WHAT" = kernels ] || [ "$WHAT" = all ]; then
  stamp "4-bit tests on CUDA"
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_nf4_gemm.py \
    tests/kernels/test_large_offsets.py tests/model_executor/test_bnb_quantizer.py \
    tests/model_executor/test_bnb_loading.py} >"$OUT/nf4_tests.log" 2>&1
  tail -3 "$OUT/nf4_tests.log"
  stamp "NF4 GEMM sweep, 11B shapes"
  # Four shapes x four row counts took about 9 minutes on the H200 (2026-12-02); where a run
  # has a shorter time limit, split SHAPES (or ROWS) over runs.
  timeout "${SWEEP_S:-540}" python3 -m benchmarks.kernels nf4 --sweep --table --silu --jobs 14 \
    --rows "${ROWS:-1,4,16,64}" --shapes "${SHAPES:-qkv,o_proj,gate_up,down}" \
    --json "$OUT/nf4_11b.json" >"$OUT/nf4_sweep.log" 2>&1
  tail -2 "$OUT/nf4_sweep.log"
  cp vllm/model_executor/layers/nf4_configs/*.json "$OUT/" 2>/dev/null
  python3 - "$OUT/nf4_11b.json" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
print(f"copy {rep['copy_gb_s']:.0f} GB/s, read {rep['read_gb_s']:.0f} GB/s")
print("shape      M   bf16 us  scratch us   pairs us (%read)   mma us (%read)     "
      "table us (%read)   bnb us   chosen")
nan = {"us": float("nan"), "pct_read": float("nan")}
for r in rep["nf4"]:
    b = r.get("bnb_matmul_4bit", nan)["us"]
    cells = [r.get(f"nf4_best_{kind}", nan) for kind in ("pairs", "mma", "table")]
    choice = r.get("choice", "-")
    if not isinstance(choice, str):
        kind = next((k for k in ("pairs", "mma", "table") if choice.get(k)), "cuda-core")
        choice = "/".join(str(choice[k]) for k in ("block_m", "block_n", "blocks_per_iter",
                                                   "split_k", "num_warps")) + " " + kind
    print(f"{r['shape']:8s} {r['m']:4d} {r['bf16']['us']:8.1f} {r['scratch']['us']:10.1f} "
          + " ".join(f"{c['us']:9.1f} ({c['pct_read']:5.1f})" for c in cells)
          + f" {b:8.1f}   {choice}")
PY
fi
if [ "$WHAT" = engine ] || [ "$WHAT" = all ]; then
  stamp "engine: bf16 against NF4 dummy weights, 11B"
  timeout "${ENGINE_S:-500}" python3 -m benchmarks.engine quant --steps "${STEPS:-30}" --formats bf16,bitsandbytes --batches "${BATCHES:-1,2,4,8,16,64,256}" \
    --out "$OUT/quant_11b.json" >"$OUT/quant_11b.log" 2>&1
  tail -25 "$OUT/quant_11b.log"
fi
if [ "$WHAT" = 90b ] || [ "$WHAT" = all ]; then
  stamp "engine: 90B NF4 dummy weights on one GPU"
  timeout "${ENGINE90_S:-300}" python3 -m benchmarks.engine quant --model demo/mllama-90b \
    --formats bitsandbytes --batches "${BATCHES90:-1}" --steps "${STEPS:-30}" \
    --out "$OUT/quant_90b.json" >"$OUT/quant_90b.log" 2>&1
  grep -E "Model weights|Engine ready|Captured|bs=|TTFT|Error" "$OUT/quant_90b.log" | tail -12
fi
stamp done
