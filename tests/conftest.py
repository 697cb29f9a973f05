"""Shared test set-up: CPU-friendly defaults and the helpers package on sys.path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter (on CPU tensors). The flag is read
# when kernels are defined, so it is set before any test imports them.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Interpreted kernels are bounds-checked: a load or store outside the tensors a kernel was
# given fails the test (on a GPU it would corrupt memory or fault later, elsewhere).
if os.environ.get("TRITON_INTERPRET") == "1":
    from helpers.triton_bounds import install, patch_scalar_index

    install()
    patch_scalar_index()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bnb_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``name -> folder``: bitsandbytes 4-bit checkpoints of the tiny demo model, written by
    transformers + bitsandbytes on first use (``helpers/bnb_checkpoints.py`` lists them)."""
    from helpers.bnb_checkpoints import VARIANTS, make_checkpoint

    root = tmp_path_factory.mktemp("bnb")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_checkpoint(root / name, VARIANTS[name])
        return made[name]

    return get


@pytest.fixture(scope="session")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``name -> folder``: FP8 checkpoints of the tiny demo model, written by compressed-tensors
    on first use (``helpers/fp8_checkpoints.py`` lists them)."""
    from helpers.fp8_checkpoints import VARIANTS, make_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_checkpoint(root / name, VARIANTS[name])
        return made[name]

    return get
