"""OpenAI-style chat messages -> an engine prompt, through the tokenizer's chat template.

Message content is a string or a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": ...}}`` (offline, also ``{"type": "image_pil",
"image_pil": <PIL.Image>}``). Image parts become ``{"type": "image"}`` for the template, which
renders ``<|image|>`` for each; the images themselves are loaded separately, in order, and
handed to the engine with the token ids.

The rendered text already carries ``<|begin_of_text|>``, so it is tokenized without special
tokens (vLLM's ``add_special_tokens=False`` default for chat); the engine gets token ids and
never adds a second BOS.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.entrypoints.chat_template import ChatTemplateBudget, render_template
from vllm.multimodal.image import ImageMediaConnector, check_image
from vllm.multimodal.image_identity import EncodedImageLookup
from vllm.transformers_utils.segment_tokenizer import segment_tokenizer

# Keys a request's chat_template_kwargs may not override (they are set from the request).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
    }
)
_PASSTHROUGH_KEYS = ("name", "tool_calls", "tool_call_id")
# ``chat_template_content_format``: how list content reaches the template. "openai" keeps the
# parts (what this model's template reads; "auto" picks it); "string" joins them into one
# string, an image placeholder per image part ahead of the text, as vLLM does.
CONTENT_FORMATS = ("auto", "string", "openai")
IMAGE_PLACEHOLDER = "<|image|>"


@dataclass
class ParsedConversation:
    """Messages ready for the template, and the images their parts named, in order."""

    messages: list[dict[str, Any]]
    image_sources: list[Any] = field(default_factory=list)  # URL strings or PIL images


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, or the template itself (anything with a ``{``)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if any(c in value for c in "{\n"):
        return value
    raise ValueError(
        f"The chat template {value!r} is neither a readable file nor a template "
        "(a Jinja template contains '{')."
    )


def _parse_part(part: Any, where: str, images: list[Any]) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ValueError(f"{where} must be an object with a 'type'.")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text'.")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}.")
        images.append(url)
        return {"type": "image"}
    if kind == "image_pil":
        images.append(part.get("image_pil"))
        return {"type": "image"}
    raise ValueError(
        f"{where}: unsupported content part type {kind!r} (this model takes "
        "'text' and 'image_url')."
    )


def parse_conversation(messages: Any, content_format: str = "auto") -> ParsedConversation:
    """Validates OpenAI messages and converts image parts (raises ValueError); with
    ``content_format="string"`` list content becomes one string (see ``CONTENT_FORMATS``)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
            f"got {content_format!r}."
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list.")
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'.")
        content = msg.get("content")
        if isinstance(content, list):
            content = [
                _parse_part(p, f"messages[{i}].content[{j}]", images) for j, p in enumerate(content)
            ]
            if content_format == "string":
                content = _as_string(content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts.")
        converted = {"role": msg["role"], "content": content}
        converted.update({k: msg[k] for k in _PASSTHROUGH_KEYS if k in msg})
        if isinstance(converted.get("tool_calls"), list):
            converted["tool_calls"] = [_template_tool_call(c) for c in converted["tool_calls"]]
        out.append(converted)
    return ParsedConversation(out, images)


def _template_tool_call(call: Any) -> Any:
    """An assistant message's tool call as templates read it: OpenAI sends the arguments as
    JSON text, templates render them as an object (upstream's conversion)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _as_string(parts: list[dict[str, Any]]) -> str:
    """Parts as one string: the image placeholders the text lacks first, then the texts."""
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    missing = sum(p["type"] == "image" for p in parts) - text.count(IMAGE_PLACEHOLDER)
    return "\n".join([IMAGE_PLACEHOLDER] * max(0, missing) + [text])


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str:
    """The template source: ``chat_template`` (or the name of one of the tokenizer's), else
    the tokenizer's own (its ``default`` when it has several)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        if chat_template is not None:
            return own.get(chat_template, chat_template)
        own = own.get("default")
    source = chat_template if chat_template is not None else own
    if not isinstance(source, str) or not source:
        raise ValueError("The tokenizer has no chat template; pass one with --chat-template.")
    return source


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON types only (anything else becomes a placeholder,
    so no object with methods the sandbox does not know reaches it)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _list_of_dicts(name: str, value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"chat_template_kwargs: {name} must be a list of objects.")
    return value


def _template_context(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The special tokens, the request's kwargs, then the messages (None fields dropped)."""
    context = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    context.update(kwargs)
    context["tools"] = _list_of_dicts("tools", kwargs.get("tools"))
    context["documents"] = _list_of_dicts("documents", kwargs.get("documents"))
    context["messages"] = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context["add_generation_prompt"] = add_generation_prompt
    try:
        return _plain(context)
    except RecursionError:
        raise ValueError("The messages or chat_template_kwargs are nested too deeply.") from None


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``continue_final_message``: the last text of the final message gets a tag, so that the
    rendered prompt can be cut right after it (whatever the template puts after a message)."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        texts = [p for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if not texts:
            raise ValueError("continue_final_message: the final message has no text to continue.")
        texts[-1]["text"] += _CONTINUE_TAG
        last["content"] = parts
    else:
        raise ValueError("continue_final_message: the final message has no text to continue.")
    return [*messages[:-1], last]


def _cut_after_final_message(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template did not render the final message."
        )
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    budget: ChatTemplateBudget | None = None,
) -> str:
    """Renders the chat template in the budgeted sandbox (see ``chat_template``); every
    failure, budget overruns included, is a ``ValueError`` whose message suits the client."""
    source = resolve_chat_template(tokenizer, chat_template)
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true."
        )
    if not messages:
        raise ValueError("messages must be a non-empty list.")
    extra = {
        k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS
    }
    if continue_final_message:
        messages = _mark_final_message(messages)
    context = _template_context(tokenizer, messages, add_generation_prompt, extra)
    text = render_template(source, context, budget)
    return _cut_after_final_message(text) if continue_final_message else text


def tokenize_chat_prompt(
    tokenizer: Any, text: str, add_special_tokens: bool = False, cache_salt: str | None = None
) -> list[int]:
    """The rendered prompt's ids. Without the tokenizer's own special tokens (the chat
    default), the history a client resends is not tokenized again (``segment_tokenizer``;
    its cache is kept apart per ``cache_salt``, as the other caches are)."""
    if add_special_tokens:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return segment_tokenizer(tokenizer).encode(text, cache_salt)


def make_prompt(token_ids: list[int], text: str, images: list[Any]) -> dict[str, Any]:
    """The engine prompt: token ids (the rendered text kept for outputs) plus images."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "prompt": text}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _render_and_tokenize(
    tokenizer: Any,
    parsed: ParsedConversation,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool,
    budget: ChatTemplateBudget | None = None,
    cache_salt: str | None = None,
) -> tuple[str, list[int]]:
    text = render_chat_prompt(
        tokenizer,
        parsed.messages,
        chat_template,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        budget,
    )
    return text, tokenize_chat_prompt(tokenizer, text, add_special_tokens, cache_salt)


def parse_chat_messages(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    media: ImageMediaConnector | None = None,
    content_format: str = "auto",
    lookup: EncodedImageLookup | None = None,
) -> dict[str, Any]:
    """Blocking: messages -> ``{"prompt_token_ids", "prompt", "multi_modal_data"}`` (offline
    ``LLM.chat``). Image URLs are loaded with ``media`` (default rules if omitted), through
    the processed-image cache when ``lookup`` (``MllamaInputProcessor.image_lookup``) is given."""
    parsed = parse_conversation(messages, content_format)
    text, ids = _render_and_tokenize(
        tokenizer,
        parsed,
        chat_template,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        False,
    )
    media = media or ImageMediaConnector()
    images = [
        check_image(src, f"image {i}")
        if not isinstance(src, str)
        else media.fetch_image(src, lookup)
        for i, src in enumerate(parsed.image_sources)
    ]
    return make_prompt(ids, text, images)


async def parse_chat_messages_async(
    parsed: ParsedConversation,
    tokenizer: Any,
    media: ImageMediaConnector,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    budget: ChatTemplateBudget | None = None,
    lookup: EncodedImageLookup | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The server's path: the template (under ``budget``) and tokenizer run in a worker thread
    while the images are fetched and decoded concurrently, all of them within the media
    connector's per-request deadline; nothing here blocks the event loop. With ``lookup``
    (``MllamaInputProcessor.image_lookup``) an image the processed-image cache holds is not
    decoded."""
    for src in parsed.image_sources:
        if not isinstance(src, str):
            raise ValueError("image_pil parts are only supported offline; send image_url.")
    render = asyncio.to_thread(
        _render_and_tokenize,
        tokenizer,
        parsed,
        chat_template,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        add_special_tokens,
        budget,
        cache_salt,
    )
    fetches = media.fetch_images_async(parsed.image_sources, lookup)
    rendered, images = await asyncio.gather(render, fetches, return_exceptions=True)
    for r in (rendered, images):
        if isinstance(r, BaseException):
            raise r
    text, ids = rendered
    return make_prompt(ids, text, images)
