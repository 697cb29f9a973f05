"""Structured-output fields of a request -> ``GuidedDecodingParams`` (upstream v0.10's names).

``response_format`` (``text``; ``json_object``; ``json_schema`` with ``json_schema.schema``
and ``strict``), the ``guided_*`` extensions (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern``,
``guided_decoding_backend``) and the newer ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``disable_any_whitespace``,
``whitespace_pattern``). One request asks for at most one constraint; anything malformed is
a ``GuidedDecodingError`` (a 400) that names the field.
"""

from __future__ import annotations

from typing import Any

from vllm.guided_params import GuidedDecodingError, GuidedDecodingParams

_STRUCTURED_KEYS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
    "whitespace_pattern",
    "structural_tag",
    "backend",
)


def from_response_format(rf: dict[str, Any] | None) -> dict[str, Any]:
    """The constraint ``response_format`` asks for, as GuidedDecodingParams keywords."""
    if rf is None:
        return {}
    kind = rf.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise GuidedDecodingError(
                "response_format: a json_schema response format needs json_schema.schema, "
                "a JSON schema object."
            )
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise GuidedDecodingError("response_format: json_schema.strict must be a boolean.")
        return {"json": spec["schema"]}
    if kind == "structural_tag":
        raise GuidedDecodingError("response_format type 'structural_tag' is not supported yet.")
    raise GuidedDecodingError(
        f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'."
    )


def from_structured_outputs(value: dict[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise GuidedDecodingError(f"structured_outputs: unknown field(s) {', '.join(unknown)}.")
    return {k: v for k, v in value.items() if v is not None}


def guided_params(request: Any) -> GuidedDecodingParams | None:
    """The request's constraint, from whichever field set it (more than one: an error)."""
    sources = {
        "response_format": from_response_format(request.response_format),
        "structured_outputs": from_structured_outputs(request.structured_outputs),
        "guided_*": {
            k: v
            for k, v in (
                ("json", request.guided_json),
                ("regex", request.guided_regex),
                ("choice", request.guided_choice),
                ("grammar", request.guided_grammar),
                ("whitespace_pattern", request.guided_whitespace_pattern),
            )
            if v is not None
        },
    }
    used = [name for name, kw in sources.items() if kw]
    if len(used) > 1:
        raise GuidedDecodingError(
            f"Only one kind of structured output per request: {' and '.join(used)} both ask "
            "for one."
        )
    if not used:
        return None
    kwargs = dict(sources[used[0]])
    if request.guided_decoding_backend is not None:
        kwargs.setdefault("backend", request.guided_decoding_backend)
    return GuidedDecodingParams(**kwargs)
