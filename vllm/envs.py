"""Every environment variable the package reads, in one place: typed, documented, checked.

Environment variables are for process-level switches only (logging, where demo checkpoints
live, server-wide defaults that vLLM also reads from the environment). A choice that belongs
to one engine is an engine argument (``EngineArgs``), not a variable here.

Read a value as an attribute (``envs.VLLM_LOGGING_LEVEL``): it is parsed on every read, so
tests can set the variable at any time. An unset or empty variable gives the default; a value
that does not parse raises :class:`EnvironmentVariableError` naming the variable.
``python -m vllm.envs`` prints the table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


class EnvironmentVariableError(ValueError):
    """An environment variable holds a value its type does not accept."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, default, parser (raises ValueError) and documentation."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError as e:
            raise EnvironmentVariableError(
                f"environment variable {self.name}={raw!r}: {e}"
            ) from None


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a positive finite number")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return raw

    return parse


def _log_level(raw: str) -> str:
    level = raw.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def _host_list(raw: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in raw.split(",") if h.strip())


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


_VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        "VLLM_LOGGING_LEVEL",
        "INFO",
        _log_level,
        "Level of the package's logger (DEBUG, INFO, WARNING, ERROR, CRITICAL).",
    ),
    EnvVar("VLLM_API_KEY", None, str, "The server's API key when --api-key is not given."),
    EnvVar(
        "VLLM_ATTENTION_BACKEND",
        None,
        _choice("TRITON", "TORCH", "FLASH_ATTN", "XFORMERS", "FLASHINFER"),
        "Attention back-end on CUDA: TRITON (default) or TORCH (plain torch, for "
        "debugging). The CPU always runs TORCH. Upstream vLLM's FLASH_ATTN, XFORMERS and "
        "FLASHINFER are accepted with a warning and run TRITON.",
    ),
    EnvVar(
        "VLLM_DEMO_DIR",
        None,
        os.path.expanduser,
        "Folder of the generated demo checkpoints (default ~/.cache/vllm-mllama/demo).",
    ),
    EnvVar(
        "VLLM_MAX_REQUEST_BODY_BYTES",
        None,
        _positive_int,
        "The server's request body limit when --max-request-body-bytes is not given "
        "(default 32 MiB).",
    ),
    EnvVar(
        "VLLM_ALLOWED_IMAGE_HOSTS",
        (),
        _host_list,
        "Comma-separated hosts or networks added to --allowed-image-hosts.",
    ),
    EnvVar(
        "VLLM_IMAGE_FETCH_TIMEOUT",
        5.0,
        _positive_float,
        "Seconds allowed to fetch one http(s) image.",
    ),
    EnvVar(
        "VLLM_IMAGE_FETCH_MAX_BYTES",
        20 << 20,
        _positive_int,
        "Largest image, in bytes, fetched from a URL or read from a file.",
    ),
    EnvVar(
        "VLLM_IMAGE_MAX_PIXELS",
        64 << 20,
        _positive_int,
        "Largest image, in pixels (width x height), that is decoded. The default is far "
        "above what the model sees (at most 4 tiles of 560 x 560) and below Pillow's own "
        "decompression-bomb error (2 x 89.5 Mpx), so this limit's message is the one "
        "users get.",
    ),
    EnvVar(
        "TRITON_INTERPRET",
        False,
        _flag,
        "Triton's own switch (1: kernels run in Triton's interpreter, on CPU tensors); "
        "read here so kernels that need exact products under the interpreter know it.",
    ),
    EnvVar(
        "OPENAI_API_KEY", None, str, "API key `vllm bench serve` sends (the OpenAI SDK's variable)."
    ),
)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARIABLES}

if TYPE_CHECKING:
    VLLM_LOGGING_LEVEL: str
    VLLM_API_KEY: str | None
    VLLM_ATTENTION_BACKEND: str | None
    VLLM_DEMO_DIR: str | None
    VLLM_MAX_REQUEST_BODY_BYTES: int | None
    VLLM_ALLOWED_IMAGE_HOSTS: tuple[str, ...]
    VLLM_IMAGE_FETCH_TIMEOUT: float
    VLLM_IMAGE_FETCH_MAX_BYTES: int
    VLLM_IMAGE_MAX_PIXELS: int
    TRITON_INTERPRET: bool
    OPENAI_API_KEY: str | None


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def check_all() -> None:
    """Parses every variable once (raises on the first bad value): called at start-up so a
    typo fails at once rather than at first use."""
    for var in _VARIABLES:
        var.read()


# What ``vllm collect-env`` shows of the environment besides this package's variables.
_REPORTED_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TRITON_", "HF_", "TRANSFORMERS_")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def report() -> list[tuple[str, str]]:
    """The variables a bug report should show, as set (unparsed): this package's and the
    CUDA / torch / Triton / Hugging Face ones; a value whose name says it is a secret (a key,
    a token, a password) is shown as ``***``."""
    names = set(VARIABLES) | {n for n in os.environ if n.startswith(_REPORTED_PREFIXES)}
    out = []
    for name in sorted(names):
        raw = os.environ.get(name)
        if raw is None:
            continue
        secret = any(word in name for word in _SECRET_WORDS)
        out.append((name, "***" if secret and raw else raw))
    return out


def describe() -> str:
    """A table of every variable, its default and what it does."""
    lines = []
    for var in _VARIABLES:
        lines.append(f"{var.name} (default {var.default!r}): {var.doc}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
