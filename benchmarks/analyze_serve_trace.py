"""Lines a serving benchmark result (``--save-detailed``) up with a ``trace_serve.py`` trace:
ITL percentiles, step-time percentiles, JIT compiles during the load, and for each burst of
ITLs above a threshold the engine steps it spanned.

Usage: ``python benchmarks/analyze_serve_trace.py RESULT.json TRACE.json [--threshold-ms 20]``
Step flags: E = an image encoding was pending before the step, P / p = a spread prefill was in
progress before / after it; ``r``/``w`` = running / waiting requests after it; with traces that
have them, ``L``/``C`` = host ms inside the runner's launch / collect (collect mostly waits for
the GPU, so a long step with a short collect was held up on the host) and ``A`` = prompt
tokens admitted in the step.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def chunk_times(result: dict) -> list[tuple[float, float, int]]:
    """(arrival time, ITL ms, request) of every output chunk after the first."""
    out = []
    for r, (sent, ttft, itls) in enumerate(zip(result["send_times"], result["ttfts"],
                                               result["itls"], strict=True)):
        t = sent + ttft
        for gap in itls:
            t += gap
            out.append((t, gap * 1e3, r))
    return out


def bursts(chunks: list[tuple[float, float, int]], threshold_ms: float,
           window_s: float = 0.004) -> list[list[tuple[float, float, int]]]:
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
    return text + ")"


def report(result: dict, trace: dict, threshold_ms: float = 20.0) -> list[str]:
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
        lines.append(f"steps during the load {len(ms)}: p50 {p50:.2f} p99 {p99s:.2f} "
                     f"max {top:.2f} ms")
    jit = [e for e in trace["events"] if e[0] == "jit" and e[1] > start]
    lines.append(f"JIT compiles during the load: {len(jit)}")
    lines += [f"  +{e[1] - start:.3f} s {(e[2] - e[1]) * 1e3:.1f} ms {e[3][:100]}" for e in jit]
    groups = bursts(chunks, threshold_ms)
    lines.append(f"{sum(map(len, groups))} ITLs > {threshold_ms:g} ms in {len(groups)} bursts")
    for g in groups:
        end, gap = g[0][0], max(c[1] for c in g) / 1e3
        near = steps[(steps[:, 1] > end - gap - 0.002) & (steps[:, 0] < end)]
        desc = " ".join(_step(row) for row in near)
        lines.append(f"  +{end - start:.3f} s: {len(g)} ITLs up to {gap * 1e3:.1f} ms | {desc}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result")
    p.add_argument("trace")
    p.add_argument("--threshold-ms", type=float, default=20.0)
    a = p.parse_args()
    with open(a.result) as f, open(a.trace) as g:
        print("\n".join(report(json.load(f), json.load(g), a.threshold_ms)))


if __name__ == "__main__":
    main()
