"""The table of ``tools/gpu_serving.sh``: every run under a folder against the issue's targets.

Reads ``w{1,2}_{variant}.json`` (``vllm bench serve`` results), the ``/metrics`` snapshots
taken before and after each run (``.metrics.before.txt``, ``.metrics.txt``: the decode steps
replayed from graphs and run eagerly during the run) and ``w1_sweep.json``; writes
``serving_summary.json`` and ``serving_summary.md`` there and prints the table.

    python tools/serving_table.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RUN = re.compile(r"^(w\d)_(.+)\.json$")


def counter(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_steps(folder: Path, tag: str) -> tuple[float, float]:
    """(graph replays, eager decode steps) during the run ``tag``."""
    after = folder / f"{tag}.metrics.txt"
    before = folder / f"{tag}.metrics.before.txt"
    if not after.is_file() or not before.is_file():
        return float("nan"), float("nan")
    a, b = after.read_text(), before.read_text()
    names = ("vllm:cuda_graph_replays_total", "vllm:eager_decode_steps_total")
    replays, eager = (counter(a, n) - counter(b, n) for n in names)
    return replays, eager


def row(folder: Path, path: Path) -> dict:
    workload, variant = RUN.match(path.name).groups()  # type: ignore[union-attr]
    r = json.loads(path.read_text())
    replays, eager = decode_steps(folder, path.stem)
    return {
        "workload": workload,
        "variant": variant,
        "completed": r["completed"],
        "failed": r.get("failed", 0),
        "output_tok_s": r["output_throughput"],
        "ttft_p50_ms": r["median_ttft_ms"],
        "ttft_p99_ms": r["p99_ttft_ms"],
        "itl_p50_ms": r["median_itl_ms"],
        "itl_p99_ms": r["p99_itl_ms"],
        "graph_replays": replays,
        "eager_decode_steps": eager,
    }


def with_targets(rows: list[dict]) -> list[dict]:
    """Adds the targets (throughput >= 95% of prefill-first's in the same workload, p99 ITL
    <= 3x median and <= 60 ms, TTFT median <= 300 ms and p99 <= 1.5 s, no eager decode)."""
    base = {r["workload"]: r for r in rows if r["variant"] == "prefill_first"}
    for r in rows:
        ref = base.get(r["workload"])
        r["throughput_vs_prefill_first"] = (
            r["output_tok_s"] / ref["output_tok_s"] if ref and ref["output_tok_s"] else None
        )
        ratio = r["itl_p99_ms"] / r["itl_p50_ms"] if r["itl_p50_ms"] else float("inf")
        r["itl_p99_over_p50"] = ratio
        r["targets"] = {
            "1_throughput": r["throughput_vs_prefill_first"] is not None
            and r["throughput_vs_prefill_first"] >= 0.95,
            "2_itl": ratio <= 3 and r["itl_p99_ms"] <= 60,
            "3_ttft": r["ttft_p50_ms"] <= 300 and r["ttft_p99_ms"] <= 1500,
            "4_graphs": r["eager_decode_steps"] == 0,
        }
    return rows


def markdown(rows: list[dict], sweep: list[dict]) -> str:
    out = [
        "| workload | variant | output tok/s | vs prefill-first | TTFT p50 / p99 (ms) | "
        "ITL p50 / p99 (ms) | p99/p50 | eager decode | targets met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = r["throughput_vs_prefill_first"]
        met = " ".join(k.split("_")[0] for k, ok in r["targets"].items() if ok) or "-"
        out.append(
            f"| {r['workload']} | {r['variant']} | {r['output_tok_s']:,.0f} | "
            f"{'-' if rel is None else f'{rel:.0%}'} | "
            f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['itl_p99_over_p50']:.1f}x | "
            f"{r['eager_decode_steps']:g} | {met} |"
        )
    if sweep:
        out += [
            "",
            "| request rate | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
            "|---|---|---|---|",
        ]
        for s in sweep:
            out.append(
                f"| {s['request_rate']} | {s['output_throughput']:,.0f} | "
                f"{s['median_ttft_ms']:,.0f} / {s['p99_ttft_ms']:,.0f} | "
                f"{s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} |"
            )
    return "\n".join(out) + "\n"


def main(folder: Path) -> str:
    runs = sorted(
        p for p in folder.glob("w*_*.json") if RUN.match(p.name) and "sweep" not in p.name
    )
    rows = with_targets([row(folder, p) for p in runs])
    sweep_file = folder / "w1_sweep.json"
    sweep = json.loads(sweep_file.read_text())["runs"] if sweep_file.is_file() else []
    table = markdown(rows, sweep)
    (folder / "serving_summary.json").write_text(
        json.dumps(
            {
                "runs": rows,
                "sweep": sweep
                and [
                    {
                        k: s[k]
                        for k in (
                            "request_rate",
                            "output_throughput",
                            "median_ttft_ms",
                            "p99_ttft_ms",
                            "median_itl_ms",
                            "p99_itl_ms",
                        )
                    }
                    for s in sweep
                ],
            },
            indent=1,
        )
        + "\n"
    )
    (folder / "serving_summary.md").write_text(table)
    return table


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
