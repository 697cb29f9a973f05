"""A PNG of a ``vllm bench serve --request-rate`` sweep, drawn with Pillow.

Three panels against the request rate (one tick per rate, ``inf`` last): TTFT median and p99,
ITL median and p99 (ms), and output throughput (tok/s). Pillow is already a dependency (image
inputs), so the plot needs nothing more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

PANELS = (
    ("TTFT (ms)", (("median_ttft_ms", "median"), ("p99_ttft_ms", "p99"))),
    ("ITL (ms)", (("median_itl_ms", "median"), ("p99_itl_ms", "p99"))),
    ("Output throughput (tok/s)", (("output_throughput", "output"),)),
)
COLOURS = ((31, 119, 180), (214, 39, 40))
WIDTH, HEIGHT, MARGIN = 420, 320, 56


def _nice_max(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value``."""
    if value <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(value))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= value)


def _label(rate: Any) -> str:
    if rate in ("inf", None) or rate == float("inf"):
        return "inf"
    return f"{float(rate):g}"


def _panel(
    draw: ImageDraw.ImageDraw,
    x0: int,
    title: str,
    series: list[list[float | None]],
    names: list[str],
    rates: list[str],
) -> None:
    left, top = x0 + MARGIN, MARGIN // 2 + 14
    right, bottom = x0 + WIDTH - 16, HEIGHT - MARGIN
    draw.text((left, 6), title, fill="black")
    values = [v for s in series for v in s if v is not None]
    y_max = _nice_max(max(values) if values else 1.0)
    draw.rectangle((left, top, right, bottom), outline="black")
    for k in range(5):  # horizontal grid lines with their values
        y = bottom - (bottom - top) * k / 4
        draw.line((left, y, right, y), fill=(225, 225, 225))
        draw.text((x0 + 4, y - 6), f"{y_max * k / 4:g}", fill="black")
    n = len(rates)

    def x_of(i: int) -> float:
        return left + (right - left) * (i + 0.5) / n

    for i, rate in enumerate(rates):
        draw.text((x_of(i) - 3 * len(rate), bottom + 6), rate, fill="black")
    draw.text(((left + right) // 2 - 48, bottom + 24), "request rate (req/s)", fill="black")
    for j, (s, name) in enumerate(zip(series, names, strict=True)):
        colour = COLOURS[j % len(COLOURS)]
        points = [
            (x_of(i), bottom - (bottom - top) * v / y_max) for i, v in enumerate(s) if v is not None
        ]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for px, py in points:
            draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=colour)
        draw.text((right - 110 + 55 * j, 6), name, fill=colour)  # the legend, by the title


def plot_sweep(records: list[dict[str, Any]], path: Path) -> Path:
    """Writes the three panels for ``records`` (one per request rate, in order) to ``path``."""
    rates = [_label(r.get("request_rate")) for r in records]
    image = Image.new("RGB", (WIDTH * len(PANELS), HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    for k, (title, keys) in enumerate(PANELS):
        series = [[r.get(key) for r in records] for key, _ in keys]
        _panel(draw, k * WIDTH, title, series, [name for _, name in keys], rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path
