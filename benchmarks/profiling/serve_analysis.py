"""Lines a serving benchmark result (``--save-detailed``) up with a step trace
(``python -m benchmarks.profiling serve``): ITL percentiles, step-time percentiles, JIT
compiles during the load, and for each burst of ITLs above a threshold the engine steps it
spanned.

Usage: ``python -m benchmarks.profiling analyze RESULT.json [TRACE.json] [--threshold-ms 20]
[--by-length]`` (``--by-length``: stalls around each request's prefill, split by whether its
prompt length is new in the run; needs no trace).
Step flags: E = an image encoding was pending before the step, P / p = a spread prefill was in
progress before / after it; ``r``/``w`` = running / waiting requests after it; with traces that
have them, ``L``/``C`` = host ms inside the runner's launch / collect (collect mostly waits for
the GPU, so a long step with a short collect was held up on the host), ``A`` = prompt
tokens admitted in the step and ``M/F/R`` = the caching allocator's cudaMallocs, cudaFrees
and retries since the previous step (shown when any is non-zero).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def chunk_times(result: dict) -> list[tuple[float, float, int]]:
    """(arrival time, ITL ms, request) of every output chunk after the first."""
    out = []
    for r, (sent, ttft, itls) in enumerate(
        zip(result["send_times"], result["ttfts"], result["itls"], strict=True)
    ):
        t = sent + ttft
        for gap in itls:
            t += gap
            out.append((t, gap * 1e3, r))
    return out


def bursts(
    chunks: list[tuple[float, float, int]], threshold_ms: float, window_s: float = 0.004
) -> list[list[tuple[float, float, int]]]:
    """ITLs above the threshold, grouped when they end within ``window_s`` of each other."""
    groups: list[list[tuple[float, float, int]]] = []
    for c in sorted((c for c in chunks if c[1] > threshold_ms), key=lambda c: c[0]):
        if groups and c[0] - groups[-1][-1][0] < window_s:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _flags(row: list[float]) -> str:
    return ("E" if row[4] else "-") + ("P" if row[5] else "-") + ("p" if row[6] else "-")


def _step(row: np.ndarray) -> str:
    text = f"{(row[1] - row[0]) * 1e3:.1f}{_flags(row)}(r{row[2]:.0f} w{row[3]:.0f}"
    if len(row) >= 10:
        text += f" L{row[8] * 1e3:.1f} C{row[9] * 1e3:.1f}"
    if len(row) >= 11 and row[10]:
        text += f" A{row[10]:.0f}"
    if len(row) >= 14 and (row[11] or row[12] or row[13]):
        text += f" M{row[11]:.0f}/F{row[12]:.0f}/R{row[13]:.0f}"
    return text + ")"


def report(result: dict, trace: dict, threshold_ms: float = 20.0) -> list[str]:
    """The analysis of one serving result against its step trace, as lines."""
    rows = trace["steps"]
    steps = np.array(rows, dtype=float).reshape(len(rows), -1)
    start = min(result["send_times"])
    chunks = chunk_times(result)
    itl = np.array([c[1] for c in chunks])
    med, p99 = np.median(itl), np.percentile(itl, 99)
    lines = [f"ITLs {len(itl)}: median {med:.2f} ms, p99 {p99:.2f} ms ({p99 / med:.2f}x)"]
    during = steps[steps[:, 0] > start]
    if len(during):
        ms = (during[:, 1] - during[:, 0]) * 1e3
        p50, p99s, top = np.percentile(ms, [50, 99, 100])
        lines.append(
            f"steps during the load {len(ms)}: p50 {p50:.2f} p99 {p99s:.2f} max {top:.2f} ms"
        )
    jit = [e for e in trace["events"] if e[0] == "jit" and e[1] > start]
    lines.append(f"JIT compiles during the load: {len(jit)}")
    lines += [f"  +{e[1] - start:.3f} s {(e[2] - e[1]) * 1e3:.1f} ms {e[3][:100]}" for e in jit]
    slow = sorted(
        (e for e in trace["events"] if e[0] == "slow" and e[1] > start), key=lambda e: e[1] - e[2]
    )
    if slow:
        total = sum(e[2] - e[1] for e in slow) * 1e3
        lines.append(
            f"host calls over 1 ms during the load: {len(slow)} ({total:.1f} ms), longest:"
        )
        lines += [
            f"  +{e[1] - start:.3f} s {(e[2] - e[1]) * 1e3:.1f} ms {e[3][:120]}" for e in slow[:8]
        ]
    groups = bursts(chunks, threshold_ms)
    lines.append(f"{sum(map(len, groups))} ITLs > {threshold_ms:g} ms in {len(groups)} bursts")
    for g in groups:
        end, gap = g[0][0], max(c[1] for c in g) / 1e3
        near = steps[(steps[:, 1] > end - gap - 0.002) & (steps[:, 0] < end)]
        desc = " ".join(_step(row) for row in near)
        inside = [e for e in slow if end - gap - 0.002 < e[1] < end]
        if inside:
            desc += f" | slow calls {sum(e[2] - e[1] for e in inside) * 1e3:.1f} ms: " + ", ".join(
                e[3].split(" ")[0] for e in inside[:3]
            )
        lines.append(f"  +{end - start:.3f} s: {len(g)} ITLs up to {gap * 1e3:.1f} ms | {desc}")
    return lines


def by_length(
    result: dict, threshold_ms: float = 20.0, window_s: tuple[float, float] = (0.070, 0.030)
) -> list[str]:
    """Whether a request's prefill comes with a stall, split by whether its (prompt length,
    image count) is the first of its kind in the run: for each request, the longest ITL
    (any stream) ending ``window_s[0]``..``window_s[1]`` before its first token, the span of
    a spread prefill's steps (needs the result's ``input_lens`` and ``num_images``)."""
    chunks = chunk_times(result)
    ends = np.array([c[0] for c in chunks])
    gaps = np.array([c[1] for c in chunks])
    firsts = sorted(
        (sent + ttft, n, k)
        for sent, ttft, n, k in zip(
            result["send_times"],
            result["ttfts"],
            result["input_lens"],
            result["num_images"],
            strict=True,
        )
    )
    seen: set[tuple[int, int]] = set()
    groups: dict[str, list[float]] = {"first of its length": [], "repeated length": []}
    for t, n, k in firsts:
        near = (ends > t - window_s[0]) & (ends < t - window_s[1])
        worst = float(gaps[near].max()) if near.any() else 0.0
        groups["repeated length" if (n, k) in seen else "first of its length"].append(worst)
        seen.add((n, k))
    lines = [
        f"requests by prompt length ({len(seen)} distinct (length, images) of "
        f"{len(firsts)}): longest ITL {window_s[0] * 1e3:.0f}-{window_s[1] * 1e3:.0f} ms "
        "before the first token"
    ]
    for name, worst in groups.items():
        if worst:
            over = sum(w > threshold_ms for w in worst)
            lines.append(
                f"  {name}: {len(worst)} requests, {over} above {threshold_ms:g} ms, "
                f"median {np.median(worst):.1f} ms"
            )
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Reads the files named on the command line; prints the analysis."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("result")
    p.add_argument("trace", nargs="?", help="the step trace (omit with --by-length)")
    p.add_argument("--threshold-ms", type=float, default=20.0)
    p.add_argument(
        "--by-length",
        action="store_true",
        help="also split requests by first-seen vs repeated prompt length",
    )
    a = p.parse_args(argv)
    if a.trace is None and not a.by_length:
        p.error("give a trace, or --by-length")
    with open(a.result) as f:
        result = json.load(f)
    lines = []
    if a.trace is not None:
        with open(a.trace) as g:
            lines += report(result, json.load(g), a.threshold_ms)
    if a.by_length:
        lines += by_length(result, a.threshold_ms)
    print("\n".join(lines))
