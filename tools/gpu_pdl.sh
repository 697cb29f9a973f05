#!/usr/bin/env bash
# Dependent launch (vllm/model_executor/layers/pdl.py) on one GPU: the CUDA tests of the kernels
# it touches and of graph replay with it on, then the engine's decode steps with it off and on
# (VLLM_PDL=0 / 1), one after the other on the same machine.
# Usage (repository root, offline GPU machine): bash tools/gpu_pdl.sh
#   FORMATS=bf16,fp8,bitsandbytes BATCHES=1,16,64 STEPS=20 TESTS="..." ENGINE_S=240
set -uo pipefail
source tools/gpu_env.sh || exit 1
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
stamp "CUDA tests, dependent launch on"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/kernels \
  tests/worker/test_cuda_graph.py tests/models/encoder_decoder/vision_language/test_mllama.py \
  tests/models/encoder_decoder/vision_language/test_mllama_fp8.py} >"$OUT/pdl_tests.log" 2>&1
tail -3 "$OUT/pdl_tests.log"
for pdl in ${ORDER:-0 1}; do
  stamp "engine, VLLM_PDL=$pdl"
  VLLM_PDL=$pdl timeout "${ENGINE_S:-240}" python3 -m benchmarks.engine quant \
    --steps "${STEPS:-20}" --formats "${FORMATS:-bf16,fp8,bitsandbytes}" \
    --batches "${BATCHES:-1,16,64}" --out "$OUT/quant_pdl$pdl.json" >"$OUT/quant_pdl$pdl.log" 2>&1
  tail -4 "$OUT/quant_pdl$pdl.log"
done
stamp done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {}
for pdl in ("0", "1"):
    path = os.path.join(out, f"quant_pdl{pdl}.json")
    if os.path.exists(path):
        runs[pdl] = {r["format"]: r for r in json.load(open(path))["results"]}
print("format        mix    bs   step ms off/on   linears ms off/on   ttft ms off/on")
for fmt in (runs.get("0") or runs.get("1") or {}):
    rows = {p: runs[p].get(fmt) for p in runs}
    ref = next(r for r in rows.values() if r)
    for i, d in enumerate(ref["decode"]):
        cells = []
        for key in ("step_ms", "linear_ms"):
            vals = [rows[p]["decode"][i].get(key) if rows.get(p) else None for p in ("0", "1")]
            cells.append("/".join("-" if v is None else f"{v:.3f}" for v in vals))
        ttft = "/".join(f"{rows[p]['ttft_ms']:.1f}" if rows.get(p) else "-" for p in ("0", "1"))
        print(f"{fmt:12s}  {d['mix']:5s} {d['batch']:4d}  {cells[0]:>14s}  {cells[1]:>16s}"
              f"  {ttft if i == 0 else ''}")
PY
