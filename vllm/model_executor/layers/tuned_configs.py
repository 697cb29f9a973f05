"""Per-GPU tables of tuned GEMM launch configs, shared by the weight-only quantized GEMMs.

A table (``<folder>/<GPU model>.json``, written by a kernel benchmark's ``--sweep --table``)
maps a shape key to {row count: a config's fields, or ``"scratch"``: dequantize, then the
library GEMM}. ``m`` rows take the entry of the smallest tuned row count >= m.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

C = TypeVar("C")
SCRATCH = "scratch"


class TunedTables(Generic[C]):
    """The tables of one kernel: ``folder`` holds one JSON per GPU model, ``make`` builds a
    config from an entry's fields."""

    def __init__(self, folder: Path, make: Callable[..., C]) -> None:
        self.folder = folder
        self.make = make
        self._load = functools.cache(self._read)

    def path(self, device_name: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")

    def _read(self, device_name: str) -> dict[str, dict[int, C | None]]:
        path = self.path(device_name)
        if not path.is_file():
            return {}
        raw = json.loads(path.read_text())
        return {
            key: {int(m): None if cfg == SCRATCH else self.make(**cfg) for m, cfg in rows.items()}
            for key, rows in raw["configs"].items()
        }

    def cache_clear(self) -> None:
        self._load.cache_clear()

    def lookup(self, device_name: str, key: str, m: int) -> tuple[bool, C | None]:
        """(found, entry): the entry for ``m`` rows (None: the scratch path) if the table of
        this GPU model has one for ``key``."""
        rows = self._load(device_name).get(key) if device_name else None
        tuned = sorted(r for r in rows or () if r >= m)
        if not tuned:
            return False, None
        return True, rows[tuned[0]]  # type: ignore[index]

    def entries(self, device_name: str, key: str) -> list[tuple[int, C | None]]:
        """Every (row count, entry) this GPU model's table holds for ``key``, ascending."""
        rows = self._load(device_name).get(key) if device_name else None
        return sorted((rows or {}).items())

    def merge(self, device_name: str, entries: list[tuple[str, int, object]]) -> Path:
        """Writes (key, rows, a config's fields or ``"scratch"``) entries into this GPU
        model's table, keeping its other entries; returns the path."""
        path = self.path(device_name)
        table = (
            json.loads(path.read_text()) if path.is_file() else {"gpu": device_name, "configs": {}}
        )
        for key, m, choice in entries:
            table["configs"].setdefault(key, {})[str(m)] = choice
        table["configs"] = {
            k: dict(sorted(v.items(), key=lambda t: int(t[0])))
            for k, v in sorted(table["configs"].items())
        }
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
        self.cache_clear()
        return path
