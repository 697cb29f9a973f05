"""Tokenizer loading from a local checkpoint folder (no hub access)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def get_tokenizer(path: str | Path) -> Any:
    """The checkpoint's fast tokenizer (``transformers.AutoTokenizer``), from local files only."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise OSError(f"{path}: cannot load the tokenizer ({e})") from e


def get_image_processor(path: str | Path) -> Any:
    """The checkpoint's Mllama image processor (PIL-based; torchvision is not needed)."""
    import warnings

    from transformers import AutoImageProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise OSError(f"{path}: cannot load the image processor ({e})") from e
