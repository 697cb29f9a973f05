"""Spies on a running engine's model (tests only)."""

from __future__ import annotations

import pytest

from vllm import LLM
from vllm.attention.metadata import PrefillMetadata
from vllm.forward_context import get_attention_metadata


class PrefillTokens:
    """Counts the prompt tokens the model's eager prefill forwards compute (padding rows
    not; decode replays, row chunks included, not at all)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        model = llm.llm_engine.runner.model
        self.tokens = 0
        forward = model.forward

        def spy(*args, **kwargs):
            md = get_attention_metadata()
            if isinstance(md, PrefillMetadata):
                self.tokens += sum(md.seq_lens)
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", spy)
