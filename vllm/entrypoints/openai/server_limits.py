"""The server's limits on what one request or connection may cost, resolved from the flags
(``cli_args.add_server_limit_args``) and the environment variables some of them fall back
to. docs/security.md lists each limit, its default and what a client gets past it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from vllm import envs
from vllm.entrypoints.chat_template import ChatTemplateBudget
from vllm.multimodal.image import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_REQUEST_FETCH_TIMEOUT,
)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20  # a 20 MiB image as base64, with room to spare


@dataclass(frozen=True)
class ServerLimits:
    """Every per-request and per-connection limit of one server (see docs/security.md)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    trust_request_chat_template: bool = False
    chat_template_budget: ChatTemplateBudget = ChatTemplateBudget()
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    image_decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY
    image_fetch_timeout: float = 5.0
    image_fetch_request_timeout: float = DEFAULT_REQUEST_FETCH_TIMEOUT
    max_logprob_entries: int = 1 << 18
    max_queued_requests: int = 1024
    max_queued_images: int = 256
    limit_concurrency: int = 2048
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in (
            "max_request_body_bytes",
            "image_decode_concurrency",
            "max_logprob_entries",
            "max_queued_requests",
            "max_queued_images",
            "limit_concurrency",
            "max_image_pixels",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value}")
        for name in (
            "image_fetch_timeout",
            "image_fetch_request_timeout",
            "timeout_keep_alive",
            "header_timeout",
            "body_timeout",
        ):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, "
                                 f"got {value}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits a parsed command line asks for (raises ValueError with a message)."""

        def get(name: str, default: Any = None) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        defaults = cls()
        body = get("max_request_body_bytes", envs.VLLM_MAX_REQUEST_BODY_BYTES)
        pixels = get("max_image_pixels", min(envs.VLLM_IMAGE_MAX_PIXELS, DEFAULT_MAX_IMAGE_PIXELS))
        try:
            budget = ChatTemplateBudget(
                max_steps=get("chat_template_max_steps", defaults.chat_template_budget.max_steps),
                max_chars=get("chat_template_max_chars", defaults.chat_template_budget.max_chars),
                timeout=get("chat_template_timeout", defaults.chat_template_budget.timeout),
            )
        except ValueError:
            raise ValueError(
                "--chat-template-max-steps, --chat-template-max-chars and "
                "--chat-template-timeout must be positive"
            ) from None
        return cls(
            max_request_body_bytes=DEFAULT_MAX_REQUEST_BODY_BYTES if body is None else body,
            trust_request_chat_template=bool(get("trust_request_chat_template", False)),
            chat_template_budget=budget,
            max_image_pixels=pixels,
            image_decode_concurrency=get(
                "image_decode_concurrency", defaults.image_decode_concurrency
            ),
            image_fetch_timeout=get("image_fetch_timeout", envs.VLLM_IMAGE_FETCH_TIMEOUT),
            image_fetch_request_timeout=get(
                "image_fetch_request_timeout", defaults.image_fetch_request_timeout
            ),
            max_logprob_entries=get("max_logprob_entries", defaults.max_logprob_entries),
            max_queued_requests=get("max_queued_requests", defaults.max_queued_requests),
            max_queued_images=get("max_queued_images", defaults.max_queued_images),
            limit_concurrency=get("limit_concurrency", defaults.limit_concurrency),
            timeout_keep_alive=get("timeout_keep_alive", defaults.timeout_keep_alive),
            header_timeout=get("header_timeout", defaults.header_timeout),
            body_timeout=get("body_timeout", defaults.body_timeout),
        )
