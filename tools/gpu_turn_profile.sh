#!/usr/bin/env bash
# Where a chat turn over a cached history spends its time (issue #30), one GPU, 11B shape with
# dummy bf16 weights. Parts, in this order (PARTS, default all):
#   inputs: `python -m benchmarks.profiling inputs`, a turn's input steps on this host;
#   pinned: the pinned allocation and copy a one-image request made before its pixels were
#      its processed-image cache entry;
#   turns: REPEAT second turns of one chat (`benchmarks.prefix_chat`, ~1,000 tokens of
#      history, 50 new, a 4-tile image resent) under the request timeline (`benchmarks.
#      profiling timeline`) on servers back to back (VARIANTS, default "new old off"): new
#      (the current code, sampled by py-spy when .whl/ carries it), old (tools/
#      turn_baseline.py: the input path before the tokenization cache and the one-image pixel
#      view) and off (caching off, the current code);
#   chunk: `python -m benchmarks.profiling chunk`, short chunks over a cached context as
#      decode rows and eagerly (wall and host time, cProfile of the eager image case).
# Raw files (chunk_host.json, chunk_cprofile.txt, timeline_TAG.json, turns_TAG.json, pyspy.txt,
# server logs) are packed in $OUT/raw.tgz; the tables are printed.
# Usage (repository root, offline GPU machine): bash tools/gpu_turn_profile.sh
# Env: PARTS, VARIANTS, REPEAT (10).
set -uo pipefail
source tools/gpu_env.sh || exit 1
# Raw files are written outside $OUT and packed into $OUT/raw.tgz after each part (a run may
# bring back only a few files, and a part cut short by a time limit keeps the earlier ones).
FINAL=$OUT
OUT=${RAW_DIR:-/tmp/turn_profile}
mkdir -p "$OUT"
pack() { tar czf "$FINAL/raw.tgz" -C "$OUT" .; }
PORT=${PORT:-8333}
MODEL=${MODEL:-demo/mllama-11b}
PARTS=${PARTS:-inputs pinned turns chunk}
source tools/serving_lib.sh
T0=$SECONDS
if [[ " $PARTS " == *" inputs "* ]]; then  # the input steps alone, on this host
  python3 -m benchmarks.profiling inputs --repeat 30 2>&1 | grep " ms$"
fi
if [[ " $PARTS " == *" pinned "* ]]; then  # what a one-image request used to copy
  python3 - <<'PY'
import statistics, sys, time, torch
if not torch.cuda.is_available():
    sys.exit("pinned: skipped (no CUDA)")
src = torch.randn(4, 3, 560, 560).to(torch.bfloat16).pin_memory()
xs = []
for _ in range(50):
    t0 = time.perf_counter()
    out = torch.empty((1, *src.shape), dtype=src.dtype, pin_memory=True)
    torch.stack([src], out=out)
    xs.append(1e3 * (time.perf_counter() - t0))
    del out
print(f"pinned [1, 4, 3, 560, 560] bf16 allocation + stack: median {statistics.median(xs):.3f} ms, "
      f"first {xs[0]:.3f} ms, max {max(xs):.3f} ms")
PY
fi
if [[ " $PARTS " == *" turns "* ]]; then
turns() {  # turns TAG PROGRAM [server flags...]: one server, REPEAT second turns, its timeline
  local tag=$1 prog=$2; shift 2
  SERVER_CMD=$prog start_server "turns_$tag" TIMELINE="$OUT/timeline_$tag.json" \
    --max-num-seqs 256 --max-model-len 8192 "$@" || return 1
  echo "[$((SECONDS - T0)) s] $tag server up"
  SPY=
  if [ "$tag" = new ] && [ -x /tmp/site/bin/py-spy ]; then
    /tmp/site/bin/py-spy record -p "$SRV" -r 200 -f raw -o "$OUT/pyspy.txt" --threads \
      --nonblocking -d 120 >"$OUT/pyspy.log" 2>&1 &
    SPY=$!
    sleep 1
  fi
  python3 -m benchmarks.prefix_chat --port "$PORT" --model "$MODEL" --conversations 1 \
    --concurrency 1 --turns 2 --history-words 770 --new-words 38 --output-tokens 16 \
    --repeat "${REPEAT:-10}" >"$OUT/turns_$tag.json" 2>"$OUT/turns_$tag.err" \
    || tail -5 "$OUT/turns_$tag.err"
  [ -n "$SPY" ] && { kill -INT "$SPY"; wait "$SPY"; tail -1 "$OUT/pyspy.log"; }
  stop_server
  echo "[$((SECONDS - T0)) s] $tag turns done"
  pack
}
for v in ${VARIANTS:-new old off}; do
  case $v in
    new) turns new "-m benchmarks.profiling timeline" --enable-prefix-caching ;;
    old) turns old tools/turn_baseline.py --enable-prefix-caching ;;
    off) turns off "-m benchmarks.profiling timeline" --no-enable-prefix-caching ;;
  esac
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
from benchmarks.prefix_chat import read_reports
med = {}
for tl in sorted(out.glob("timeline_*.json")):
    tag = tl.stem.split("_", 1)[1]
    turn2 = [d["turn2_ttft_ms"]["50"] for d in read_reports(out / f"turns_{tag}.json")]
    if not turn2:
        print(f"== {tag}: no report")
        continue
    med[tag] = statistics.median(turn2)
    print(f"== {tag}: second-turn TTFT ms at the client, median {med[tag]:.1f}:",
          [round(t, 1) for t in turn2])
    marks: dict[str, list[float]] = {}
    for r in json.loads(tl.read_text())["requests"][1::2]:  # the second turns
        for m in r:
            if m[0] != "step":
                marks.setdefault(m[0], []).append(1e3 * m[1])
    for name, xs in sorted(marks.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {name:14s} median {statistics.median(xs):7.2f} ms  range "
              f"{min(xs):.2f}-{max(xs):.2f}")
if "off" in med:
    print("ratios to caching off:", {t: round(m / med["off"], 3) for t, m in med.items()})
PY
fi
if [[ " $PARTS " == *" chunk "* ]]; then
  # Rows printed as they come, so that a run cut short still shows the cases it finished.
  python3 -m benchmarks.profiling chunk --out "$OUT" --repeat 5 2>&1 | tee "$OUT/chunk.log" \
    | grep --line-buffered -E '^\{|^(kind|text|image) '
  echo "[$((SECONDS - T0)) s] chunk done"
  pack
fi
