"""Checks on a raw request body that run before pydantic validates its fields: lone UTF-16
surrogates, and list lengths bounded by the model (a token list cannot be longer than the
context). Both cost O(1) or O(containers) on the event loop, never a Python step per number."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# JSON may escape UTF-16 surrogates one by one ("\ud800"); alone they are not text, and the
# tokenizer (or any UTF-8 encoder) fails on them deep inside a request.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(text: str) -> bool:
    # isascii() is O(1) in CPython (a flag on the string): base64 images skip the scan.
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


_NO_TEXT = frozenset({int, float, bool, type(None)})


def _holds_lone_surrogate(data: Any) -> bool:
    """Whether any string (key or value) in ``data`` holds a lone surrogate. The stack holds
    only containers, and a list of numbers is skipped in C (``map(type, ...)``), so a long
    list of ids costs a few nanoseconds per element and no memory."""
    if isinstance(data, str):
        return _has_lone_surrogate(data)
    stack = [data]
    while stack:  # iterative: nesting depth is the client's choice
        value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and _has_lone_surrogate(k):
                    return True
                if isinstance(v, str):
                    if _has_lone_surrogate(v):
                        return True
                elif isinstance(v, (list, dict)) and v:
                    stack.append(v)
        elif isinstance(value, list) and not _NO_TEXT.issuperset(map(type, value)):
            for v in value:
                if isinstance(v, str):
                    if _has_lone_surrogate(v):
                        return True
                elif isinstance(v, (list, dict)) and v:
                    stack.append(v)
    return False


def find_lone_surrogate(data: Any, root: str = "") -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, if any. The
    path is looked for only once one is known to exist, depth first, keeping the steps of the
    current branch alone (memory grows with the nesting depth, not with the size)."""
    if not _holds_lone_surrogate(data):
        return None
    if not isinstance(data, (list, dict)):
        return root or "body"
    frames: list[tuple[Iterator[tuple[Any, Any]], str]] = [(_items(data), root)]
    while frames:
        item = next(frames[-1][0], None)
        if item is None:
            frames.pop()
            continue
        key, value = item
        if isinstance(key, str) and _has_lone_surrogate(key):
            return _path(frames)
        step = f"[{key}]" if isinstance(key, int) else f".{key}"
        if isinstance(value, str) and _has_lone_surrogate(value):
            return _path(frames, step)
        if isinstance(value, (list, dict)) and value:
            frames.append((_items(value), step))
    return root or "body"


def _items(value: list[Any] | dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def _path(frames: list[tuple[Any, str]], last: str = "") -> str:
    return ("".join(step for _, step in frames) + last).lstrip(".") or "body"


@dataclass(frozen=True)
class RequestLimits:
    """Bounds checked on the raw request body, before any per-element validation: a token
    list cannot be longer than ``max_model_len``, a batch not larger than ``max_prompts``, a
    token-id option not longer than the vocabulary. ``None``: unchecked."""

    max_model_len: int | None = None
    max_prompts: int | None = None
    vocab_size: int | None = None


# Set per request by the server (``RequestLimitsMiddleware``); unset, nothing is checked.
REQUEST_LIMITS: ContextVar[RequestLimits | None] = ContextVar("vllm_request_limits", default=None)
NO_LIMITS = RequestLimits()


def too_long(name: str, got: int, limit: int, why: str) -> ValueError:
    return ValueError(f"{name}: has {got} items, more than {limit} ({why}).")


def check_tokens(name: str, value: Any, max_model_len: int) -> None:
    """A list that holds at least one token per item cannot be longer than the context."""
    if isinstance(value, list) and len(value) > max_model_len:
        why = f"the model's maximum context length is {max_model_len} tokens"
        raise too_long(name, len(value), max_model_len, why)


def clamp(value: float, limit: float) -> float:
    """``value`` within [-limit, limit]; NaN and infinities are left for validation to refuse."""
    return max(-limit, min(limit, value)) if math.isfinite(value) else value


def check_content_parts(messages: Any, max_model_len: int) -> None:
    """Every content part is at least one token (or an image): at most max_model_len of them."""
    if not isinstance(messages, list):
        return
    parts = sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > max_model_len:
        why = f"the model's maximum context length is {max_model_len} tokens"
        raise too_long("messages[*].content", parts, max_model_len, why)
