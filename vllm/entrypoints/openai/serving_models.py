"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model names, in vLLM's
model-card shape (an id may hold slashes: ``meta-llama/Llama-3.2-11B-Vision-Instruct``)."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from vllm.entrypoints.openai.protocol import random_id
from vllm.entrypoints.openai.serving_engine import OpenAIServingError, ServerContext


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


def _card(ctx: ServerContext, name: str) -> ModelCard:
    return ModelCard(
        id=name,
        root=ctx.model_root,
        max_model_len=ctx.max_model_len,
        permission=[ModelPermission()],
    )


def show_available_models(ctx: ServerContext) -> ModelList:
    """One card per served name (all backed by the same model)."""
    return ModelList(data=[_card(ctx, name) for name in ctx.served_model_names])


def show_model(ctx: ServerContext, name: str) -> ModelCard:
    """The card of one served name; 404 (the error of any request naming it) otherwise."""
    if name not in ctx.served_model_names:
        raise OpenAIServingError(
            f"The model `{name}` does not exist.", 404, "NotFoundError", "model"
        )
    return _card(ctx, name)
