"""Prints the table of a tools/gpu_ab.sh run: one row per report or serving run, in order."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    print("| run | bs1 text ms | bs1 image ms | bs64 mixed BW | TTFT ms | replays |")
    print("|---|---|---|---|---|---|")
    for summary in sorted(
        out.glob("*_report_*/summary.json"), key=lambda p: int(p.parent.name.split("_")[0])
    ):
        s = json.loads(summary.read_text())
        print(
            f"| {summary.parent.name} | {s['decode_bs1_text_ms']:.3f} | "
            f"{s['decode_bs1_image_ms']:.3f} | {s['bs64_mixed_bandwidth_fraction']:.3f} | "
            f"{s['ttft_image_ms']:.2f} | {s['graph_replay_fraction']:.3f} |"
        )
    print("\n| run | out tok/s | median ITL ms | p99 ITL ms | p99/median | median TTFT ms |")
    print("|---|---|---|---|---|---|")
    for result in sorted(out.glob("*_serve_*.json"), key=lambda p: int(p.name.split("_")[0])):
        r = json.loads(result.read_text())
        if "median_itl_ms" not in r:
            continue
        print(
            f"| {result.stem} | {r['output_throughput']:.0f} | {r['median_itl_ms']:.2f} | "
            f"{r['p99_itl_ms']:.2f} | {r['p99_itl_ms'] / r['median_itl_ms']:.2f} | "
            f"{r['median_ttft_ms']:.0f} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
