"""The committed per-GPU tuned tables of the FP8 and NF4 GEMMs load as the engine loads them:
every entry builds its config (a field the config class no longer has would fail the engine's
first lookup on that GPU) and fits the K of its key."""

from __future__ import annotations

import json
import re

import pytest

from vllm.model_executor.layers import fp8_gemm, nf4_gemm

TABLES = [
    (kernel, path)
    for kernel in (fp8_gemm, nf4_gemm)
    for path in sorted(kernel.TUNED.folder.glob("*.json"))
]


@pytest.mark.parametrize(
    ("kernel", "path"), TABLES, ids=[f"{k.__name__.split('.')[-1]}-{p.stem}" for k, p in TABLES]
)
def test_every_entry_builds_its_config(kernel, path) -> None:
    gpu = json.loads(path.read_text())["gpu"]
    assert kernel.TUNED.path(gpu) == path  # the file the engine opens for that GPU name
    table = kernel.TUNED._read(gpu)
    assert table
    for key, rows in table.items():
        k = int(re.search(r"k=(\d+)", key).group(1))
        blocksize = int(re.search(r"bs=(\d+)", key).group(1)) if "bs=" in key else None
        for m, cfg in rows.items():
            assert m >= 1
            if cfg is not None and blocksize is not None:  # NF4: the loop divides K
                assert cfg.fits(k, blocksize) and cfg.serves(m), (key, m, cfg)
