"""``GuidedDecodingParams``: what a request's output must match (vLLM's names and rules).

A request may ask for one constraint: a JSON schema (``json``), any JSON object
(``json_object``), a regular expression (``regex``), one of a list of strings (``choice``) or
an EBNF grammar (``grammar``; a Lark grammar is also taken). ``SamplingParams.guided_decoding``
holds it; ``vllm.sampling_params`` re-exports the class, where upstream defines it. The engine
compiles it with xgrammar (``vllm/model_executor/guided_decoding/``) before the request is
queued, and a constraint that cannot be compiled is a ``GuidedDecodingError`` (a
``ValueError``) naming the problem.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

BACKENDS = ("xgrammar", "auto")
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GuidedDecodingError(ValueError):
    """A constraint that cannot be served: malformed, unsupported, or over a limit."""


@dataclass
class GuidedDecodingParams:
    """One output constraint; exactly one of the constraint fields is set.

    ``json`` is a schema (a dict, or its JSON text); ``choice`` a non-empty list of strings.
    ``disable_any_whitespace`` makes JSON compact (no optional whitespace between tokens).
    ``backend`` may name ``xgrammar`` (or ``auto``, which is xgrammar here).
    ``whitespace_pattern`` and ``structural_tag`` are upstream fields that the xgrammar
    backend does not serve: setting them is an error that says so.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @staticmethod
    def from_optional(
        json: str | dict[str, Any] | None = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        backend: str | None = None,
        whitespace_pattern: str | None = None,
        structural_tag: str | None = None,
    ) -> GuidedDecodingParams | None:
        """The params for the fields given, or ``None`` when none is."""
        if all(
            v is None
            for v in (json, regex, choice, grammar, json_object, whitespace_pattern, structural_tag)
        ):
            return None
        if json is not None and not isinstance(json, (str, dict)):
            # A pydantic model class or instance: its JSON schema.
            schema = getattr(json, "model_json_schema", None)
            if schema is None:
                raise GuidedDecodingError(
                    f"guided_json must be a JSON schema (an object or its JSON text), got "
                    f"{type(json).__name__}."
                )
            json = schema()
        return GuidedDecodingParams(
            json=json,
            regex=regex,
            choice=choice,
            grammar=grammar,
            json_object=json_object,
            backend=backend,
            whitespace_pattern=whitespace_pattern,
            structural_tag=structural_tag,
        )

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) > 1:
            raise GuidedDecodingError(
                "You can only use one kind of guided decoding ('json', 'json_object', 'regex', "
                f"'choice', 'grammar'), got {', '.join(set_kinds)}."
            )
        if self.structural_tag is not None:
            raise GuidedDecodingError("structural_tag constraints are not supported yet.")
        if self.whitespace_pattern is not None:
            raise GuidedDecodingError(
                "guided_whitespace_pattern is not supported by the xgrammar backend (set "
                "disable_any_whitespace for compact JSON)."
            )
        if not set_kinds:
            raise GuidedDecodingError(
                "guided decoding needs one of 'json', 'json_object', 'regex', 'choice' or "
                "'grammar'."
            )
        self._check_types()
        if self.backend is not None:
            self._check_backend(self.backend)

    def _check_backend(self, backend: str) -> None:
        """``name[:option,...]`` (upstream's form); the one option is
        ``disable-any-whitespace``."""
        name, _, options = backend.partition(":")
        if name not in BACKENDS:
            raise GuidedDecodingError(
                f"guided decoding backend {backend!r} is not available; this engine serves "
                "'xgrammar'."
            )
        for option in filter(None, options.split(",")):
            if option != "disable-any-whitespace":
                raise GuidedDecodingError(
                    f"guided decoding backend option {option!r} is not supported (the one "
                    "option is 'disable-any-whitespace')."
                )
            self.disable_any_whitespace = True
        self.backend_was_auto = self.backend_was_auto or name == "auto"

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise GuidedDecodingError("guided_json must be a JSON schema object or its text.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GuidedDecodingError(f"guided_{name} must be a non-empty string.")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise GuidedDecodingError("guided_choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        """Which constraint is set: ``json``, ``json_object``, ``regex``, ``choice`` or
        ``grammar``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[Any, ...]:
        """Equal for constraints that compile to the same grammar."""
        spec: Any = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = _json.dumps(spec, sort_keys=True)
        elif isinstance(spec, list):
            spec = tuple(spec)
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties)
