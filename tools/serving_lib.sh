# Shared by the GPU serving scripts (source it): one server at a time on $PORT, its log and
# /metrics snapshots under $OUT, and `vllm bench serve` runs saved as $OUT/TAG.json.
# Needs MODEL, PORT and OUT; TRACE=1 runs servers under `python -m benchmarks.profiling serve`,
# SERVER_PY=FILE under that Python file instead of vLLM's CLI module (it gets the CLI's args),
# SERVER_CMD="ARGS" as `python3 ARGS MODEL [server args]` (no `serve` added).
SRV=
COMMON=(--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm
        --save-detailed)

start_server() {  # start_server TAG [NAME=VALUE...] [server args...]
  local tag=$1; shift
  local envs=()
  while [[ $# -gt 0 && $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("$1"); shift; done
  local server=(-m vllm.entrypoints.cli.main serve)
  if [ "${TRACE:-0}" = 1 ]; then
    export STEP_TRACE="$OUT/$tag.trace.json"
    server=(-m benchmarks.profiling serve)
  fi
  [ -n "${SERVER_PY:-}" ] && server=("$SERVER_PY" serve)
  [ -n "${SERVER_CMD:-}" ] && read -ra server <<<"$SERVER_CMD"
  env "${envs[@]}" python3 "${server[@]}" "$MODEL" --load-format dummy --dtype bfloat16 \
    --max-num-seqs 64 --port "$PORT" "$@" >"$OUT/$tag.server.log" 2>&1 &
  SRV=$!
  python3 - "$PORT" <<'PY' || { tail -30 "$OUT/$tag.server.log"; stop_server; return 1; }
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(1200):
    try:
        if httpx.get(url, timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
  grep -m1 "Engine ready" "$OUT/$tag.server.log"
}

stop_server() {
  [ -n "$SRV" ] && kill -TERM "$SRV" 2>/dev/null && wait "$SRV"
  SRV=
}
trap stop_server EXIT  # never leave a server behind

metrics() {  # metrics FILE: the server's /metrics now
  python3 -c "import httpx,sys; print(httpx.get(f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" \
    "$PORT" >"$1"
}

bench() {  # bench TAG [benchmark args...]
  local tag=$1; shift
  metrics "$OUT/$tag.metrics.before.txt"
  python3 benchmarks/benchmark_serving.py --port "$PORT" "${COMMON[@]}" "$@" --save-result \
    --result-dir "$OUT" --result-filename "$tag.json" 2>&1 | grep -E "throughput|TTFT|ITL|Wrote"
  metrics "$OUT/$tag.metrics.txt"
}

chat() {  # chat TAG [prefix_chat args...]: its report, and /metrics before and after
  local tag=$1; shift
  metrics "$OUT/$tag.metrics.before.txt"
  python3 -m benchmarks.prefix_chat --port "$PORT" --model "$MODEL" "$@" >"$OUT/$tag.json" \
    2>"$OUT/$tag.err" || tail -5 "$OUT/$tag.err"
  metrics "$OUT/$tag.metrics.txt"
  python3 - "$OUT/$tag" <<'PY'
import sys
def total(path, name):
    with open(path) as f:
        return sum(float(l.rsplit(" ", 1)[1]) for l in f if l.startswith(name))
tag = sys.argv[1]
d = {n: total(tag + ".metrics.txt", n) - total(tag + ".metrics.before.txt", n)
     for n in ("vllm:cross_cache_queries_total", "vllm:cross_cache_hits_total",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
print(tag.rsplit("/", 1)[-1], " ".join(f"{k.split(':')[1][:-6]} {v:.0f}" for k, v in d.items()))
PY
}
