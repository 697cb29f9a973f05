#!/usr/bin/env bash
# NF4 decode GEMMs against each other, one GPU, 11B shape with dummy weights. The 4-bit kernel
# tests on CUDA, the GEMM sweep at ROWS (default 1; writes this GPU's tuned entries), then the
# engine's decode steps on the same machine: "tuned" with the tuned table as the sweep left
# it, "table" with every entry of up to 8 rows replaced by the shape's 16-row entry (the
# table kernel, as the sweeps chose it there), then bf16 (ENGINES, default "tuned table bf16").
# Usage (repository root, offline GPU machine): bash tools/gpu_nf4_ab.sh
# Env: PARTS (default "tests sweep engines"), ROWS, ENGINES, SHAPES (the sweep's), PYTEST_K (a
# -k expression for the tests), SWEEP_S, ENGINE_S, BATCHES (the engine's, default 1,4).
# bitsandbytes itself: a directory holding the package on EXTRA_PYTHONPATH (its CUDA 13 library).
set -uo pipefail
source tools/gpu_env.sh || exit 1
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
TABLE=$(python3 -c "import torch; from vllm.model_executor.layers import nf4_gemm
print(nf4_gemm.tuned_table_path(torch.cuda.get_device_name()))")
PARTS=${PARTS:-tests sweep engines}
if [[ " $PARTS " == *" tests "* ]]; then
stamp "4-bit GEMM tests on CUDA"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nf4_gemm.py ${PYTEST_K:+-k "$PYTEST_K"} \
  >"$OUT/nf4_tests.log" 2>&1
tail -1 "$OUT/nf4_tests.log"
fi
if [[ " $PARTS " == *" sweep "* ]]; then
stamp "sweep at ${ROWS:-1} rows"
timeout "${SWEEP_S:-200}" python3 -m benchmarks.kernels nf4 --sweep --table --silu --jobs 14 \
  --rows "${ROWS:-1}" --shapes "${SHAPES:-qkv,o_proj,gate_up,down}" --json "$OUT/nf4_rows1.json" \
  >"$OUT/nf4_sweep.log" 2>&1
tail -1 "$OUT/nf4_sweep.log"
cp "$TABLE" "$OUT/"
python3 - "$OUT/nf4_rows1.json" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
print(f"read {rep['read_gb_s']:.0f} GB/s; us (% read), each kernel's best")
print("shape     M  bf16          pairs          mma            table          bnb")
nan = {"us": float("nan"), "pct_read": float("nan")}
for r in rep["nf4"]:
    cells = [r["bf16"], r.get("nf4_best_pairs", nan), r.get("nf4_best_mma", nan),
             r.get("nf4_best_table", nan),
             r.get("bnb_matmul_4bit", nan)]
    print(f"{r['shape']:8s} {r['m']:2d} " + "  ".join(f"{c['us']:6.1f} ({c['pct_read']:4.1f})" for c in cells))
PY
fi
engine() {  # engine TAG FORMATS
  timeout "${ENGINE_S:-120}" python3 -m benchmarks.engine quant --steps 30 --formats "$2" \
    --batches "${BATCHES:-1,4}" --out "$OUT/quant_$1.json" >"$OUT/quant_$1.log" 2>&1
  grep -E "^(bitsandbytes|bf16) +(text|image) +bs=" "$OUT/quant_$1.log" | sed "s/^/$1: /"
}
[[ " $PARTS " == *" engines "* ]] || ENGINES=" "
for e in ${ENGINES:-tuned table bf16}; do
  case $e in
    tuned | pairs) stamp "engine, the tuned table"; engine "$e" bitsandbytes ;;  # pairs: its old name
    table)
      cp "$TABLE" /tmp/tuned_nf4.json
      python3 - "$TABLE" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for rows in d["configs"].values():
    if "16" in rows:
        for m in [m for m in rows if int(m) <= 8]:
            rows[m] = rows["16"]
json.dump(d, open(sys.argv[1], "w"), indent=1)
PY
      stamp "engine, the table kernel up to 8 rows"
      engine table bitsandbytes
      cp /tmp/tuned_nf4.json "$TABLE" ;;
    bf16) stamp "engine, bf16"; engine bf16 bf16 ;;
  esac
done
stamp done
