#!/usr/bin/env bash
# Short prefill chunks as rows of the decode graph (ModelRunner._row_chunks) on one GPU, 11B
# shape with dummy bf16 weights: the CUDA tests that cover them, then three servers back to
# back: prefix caching with row chunks (the default), prefix caching with every chunk eager
# (model_runner.ROW_CHUNK_TOKENS = 0), caching off. Each runs the second-turn chat (one chat,
# 4-tile image, ~1,000 tokens of history, 50 new tokens) and the 32x4-turn chats; the first
# two also short text prompts (96 at concurrency 32, 32 tokens, 64 output tokens).
# Usage (repository root, offline GPU machine): bash tools/gpu_row_chunks.sh [server args...]
# Env: MODES (a subset of "rows eager off"), REPEAT (10), SKIP_TESTS=1.
set -uo pipefail
source tools/gpu_env.sh || exit 1
PORT=${PORT:-8323}
MODEL=${MODEL:-demo/mllama-11b}
source tools/serving_lib.sh
T0=$SECONDS
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/worker/test_row_chunks.py \
    tests/engine/test_prefix_caching.py tests/worker/test_cuda_graph.py >"$OUT/row_tests.log" 2>&1
  echo "[$((SECONDS - T0)) s] tests: $(tail -1 "$OUT/row_tests.log")"
fi
cat >"$OUT/eager_chunks.py" <<'PY'
"""vLLM's CLI with every prefill chunk run eagerly (no decode-graph rows)."""
import runpy
import vllm.worker.model_runner as m
m.ROW_CHUNK_TOKENS = 0
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
PY
for mode in ${MODES:-rows eager off}; do
  flag=--enable-prefix-caching
  SERVER_PY=
  [ "$mode" = eager ] && SERVER_PY="$OUT/eager_chunks.py"
  [ "$mode" = off ] && flag=--no-enable-prefix-caching
  start_server "rows_$mode" --max-model-len 8192 "$flag" "$@" || continue
  chat "rows_${mode}_second_turn" --conversations 1 --concurrency 1 --turns 2 \
    --history-words 770 --new-words 38 --output-tokens 64 --repeat "${REPEAT:-10}"
  chat "rows_${mode}_multi_turn" --conversations 32 --concurrency 32 --turns 4 \
    --history-words 40 --new-words 38 --output-tokens 64
  if [ "$mode" != off ]; then
    bench "rows_${mode}_short" --num-prompts 96 --max-concurrency 32 --input-len 32 \
      --output-len 64 --image-ratio 0
  fi
  metrics "$OUT/rows_$mode.final_metrics.txt"
  grep -E "^vllm:(row_chunks|prefill_chunks)_total|^vllm:eager_decode" \
    "$OUT/rows_$mode.final_metrics.txt"
  stop_server
  echo "[$((SECONDS - T0)) s] $mode done"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
from benchmarks.prefix_chat import read_reports as reports
print("server | 2nd-turn TTFT ms (median of repeats) | multi-turn tok/s | later turns TTFT "
      "p50/p99 ms | short prompts tok/s, TTFT p50/p99, ITL p50/p99 ms")
turn2, multi = {}, {}
for mode in ("rows", "eager", "off"):
    cells = []
    try:
        t = sorted(d["turn2_ttft_ms"]["50"] for d in reports(out / f"rows_{mode}_second_turn.json"))
        turn2[mode] = t[len(t) // 2]
        cells.append(f"{turn2[mode]:.1f}")
    except (OSError, ValueError, IndexError, KeyError):
        cells.append("-")
    try:
        m = reports(out / f"rows_{mode}_multi_turn.json")[0]
        lt = m["later_turns_ttft_ms"]
        multi[mode] = m["output_throughput_tok_s"]
        cells.append(f"{m['output_throughput_tok_s']:.1f} | {lt['50']:.0f} / {lt['99']:.0f}")
    except (OSError, ValueError, IndexError, KeyError):
        cells.append("- | -")
    try:
        s = json.loads((out / f"rows_{mode}_short.json").read_text())
        cells.append(f"{s['output_throughput']:.0f}, {s['median_ttft_ms']:.0f} / "
                     f"{s['p99_ttft_ms']:.0f}, {s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f}")
    except (OSError, ValueError, KeyError):
        cells.append("-")
    print(mode, "|", " | ".join(cells))
if "off" in turn2:
    for mode in ("rows", "eager"):
        if mode in turn2:
            print(f"2nd-turn TTFT {mode} / caching off: {turn2[mode] / turn2['off']:.3f}")
if "off" in multi:
    for mode in ("rows", "eager"):
        if mode in multi:
            print(f"multi-turn tok/s {mode} / caching off: {multi[mode] / multi['off']:.2f}x")
PY
