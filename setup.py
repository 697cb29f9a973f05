"""Setuptools shim: the package metadata lives in pyproject.toml.

Dependencies come from the requirements file that matches the target: a machine with
CUDA (``VLLM_TARGET_DEVICE=cuda``, the default when nvcc or a CUDA torch is present) gets
requirements-cuda.txt, anything else requirements-cpu.txt.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _read_requirements(name: str) -> list[str]:
    out: list[str] = []
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            out.extend(_read_requirements(line[3:].strip()))
        else:
            out.append(line)
    return out


def _target_device() -> str:
    explicit = os.environ.get("VLLM_TARGET_DEVICE")
    if explicit:
        return explicit
    try:
        import torch

        return "cuda" if torch.version.cuda else "cpu"
    except ImportError:
        return "cpu"


setup(install_requires=_read_requirements(f"requirements-{_target_device()}.txt"))
