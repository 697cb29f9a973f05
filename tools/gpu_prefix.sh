#!/usr/bin/env bash
# Prefix caching (issue #30) on one GPU, 11B shape with dummy bf16 weights, caching on and off
# back to back: the prefix-caching tests on CUDA, then per server
#   second_turn: one chat, 4-tile image, ~1,000 tokens of history, 50 new tokens (10 repeats);
#   multi_turn:  32 conversations at concurrency 32, 4 turns, one image per conversation;
#   cache miss:  workload 1 of tools/gpu_serving.sh (96 requests at concurrency 32).
# Writes under $OUT each server's log, prefix_{on,off}_{second_turn,multi_turn}.json and
# w1_prefix_{on,off}.json with their /metrics (the prefix and cross-group cache counters of
# each part are printed), and prints the comparison last.
# Usage (repository root, offline GPU machine): bash tools/gpu_prefix.sh [extra server args...]
# Env: PARTS (a subset of "second_turn multi_turn cache_miss"), REPEAT (10), SKIP_TESTS=1.
set -uo pipefail
source tools/gpu_env.sh || exit 1
PORT=${PORT:-8322}
MODEL=${MODEL:-demo/mllama-11b}
W1=(--num-prompts "${NUM_PROMPTS:-96}" --max-concurrency 32 --input-len 200
    --random-range-ratio 0.5 --output-len 64 --image-ratio 0.5 --image-size 1120)
source tools/serving_lib.sh
PARTS=${PARTS:-second_turn multi_turn cache_miss}
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
T0=$SECONDS
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_prefix_caching.py \
    >"$OUT/prefix_tests.log" 2>&1
  echo "[$((SECONDS - T0)) s] tests: $(tail -1 "$OUT/prefix_tests.log")"
fi
for mode in on off; do
  flag=--no-enable-prefix-caching
  [ "$mode" = on ] && flag=--enable-prefix-caching
  start_server "prefix_$mode" --max-model-len 8192 "$flag" "$@" || continue
  wanted second_turn && chat "prefix_${mode}_second_turn" --conversations 1 --concurrency 1 \
    --turns 2 --history-words 770 --new-words 38 --output-tokens 64 --repeat "${REPEAT:-10}"
  wanted multi_turn && chat "prefix_${mode}_multi_turn" --conversations 32 --concurrency 32 \
    --turns 4 --history-words 40 --new-words 38 --output-tokens 64
  wanted cache_miss && bench "w1_prefix_$mode" "${W1[@]}"
  stop_server
  echo "[$((SECONDS - T0)) s] prefix caching $mode done"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
from benchmarks.prefix_chat import read_reports as reports
rows = {}
for mode in ("on", "off"):
    nan = float("nan")
    r = dict(turn2=nan, multi=nan, later={"50": nan, "99": nan}, w1=nan)
    try:
        turn2 = sorted(d["turn2_ttft_ms"]["50"]
                       for d in reports(out / f"prefix_{mode}_second_turn.json"))
        r["turn2"] = turn2[len(turn2) // 2]
    except (OSError, ValueError, IndexError):
        pass
    try:
        multi = reports(out / f"prefix_{mode}_multi_turn.json")[0]
        r["multi"], r["later"] = multi["output_throughput_tok_s"], multi["later_turns_ttft_ms"]
    except (OSError, ValueError, IndexError):
        pass
    try:
        r["w1"] = json.loads((out / f"w1_prefix_{mode}.json").read_text())["output_throughput"]
    except (OSError, ValueError):
        pass
    rows[mode] = r
print("caching | 2nd-turn TTFT ms (median of repeats) | multi-turn tok/s | later turns "
      "TTFT p50/p99 ms | cache-miss w1 tok/s")
for mode, r in rows.items():
    print(f"{mode:7s} | {r['turn2']:8.1f} | {r['multi']:8.1f} | {r['later']['50']:.0f} / "
          f"{r['later']['99']:.0f} | {r['w1']:.1f}")
if len(rows) == 2:
    on, off = rows["on"], rows["off"]
    print(f"ratios: 2nd-turn TTFT {on['turn2'] / off['turn2']:.3f} (target <= 0.20), multi-turn "
          f"{on['multi'] / off['multi']:.2f}x (>= 2), cache miss {on['w1'] / off['w1']:.3f} (>= 0.98)")
PY
