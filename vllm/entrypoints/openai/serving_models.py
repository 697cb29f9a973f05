"""``GET /v1/models``: the served model names, in vLLM's model-card shape."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from vllm.entrypoints.openai.protocol import random_id
from vllm.entrypoints.openai.serving_engine import ServerContext


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card (informational)."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """One served model in ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(BaseModel):
    """``GET /v1/models`` body."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


def show_available_models(ctx: ServerContext) -> ModelList:
    """One card per served name (all backed by the same model)."""
    cards = [
        ModelCard(
            id=name,
            root=ctx.model_root,
            max_model_len=ctx.max_model_len,
            permission=[ModelPermission()],
        )
        for name in ctx.served_model_names
    ]
    return ModelList(data=cards)
