"""Flags of the OpenAI-compatible server (``vllm serve`` and ``python -m
vllm.entrypoints.openai.api_server``): vLLM's server flags plus every engine flag."""

from __future__ import annotations

import argparse
import json
import ssl
from pathlib import Path
from typing import Any

from vllm import envs
from vllm.engine.arg_parsing import CONFIG_FLAG
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.cli_args import resolve_model_tag
from vllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from vllm.logger import init_logger

logger = init_logger(__name__)

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SSL_CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(items, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return [str(v) for v in items]


def make_arg_parser(
    parser: argparse.ArgumentParser, positional_model: bool = False
) -> argparse.ArgumentParser:
    """Adds the server flags and the engine flags to ``parser``."""
    g = parser.add_argument_group("server arguments")
    _add_http_args(g)
    _add_chat_args(g)
    _add_tls_args(g)
    _add_upstream_only_args(g)
    _add_media_and_logging_args(g)
    add_server_limit_args(parser)
    show_defaults(g)
    EngineArgs.add_cli_args(parser, positional_model=positional_model)
    return parser


def _add_http_args(g: argparse._ArgumentGroup) -> None:
    """Where to listen, uvicorn's logging, CORS."""
    g.add_argument(
        CONFIG_FLAG,
        default=None,
        help="A YAML file of flags (max-model-len: 4096; lists for flags taking several "
        "values); flags on the command line win.",
    )
    g.add_argument(
        "--host",
        default=None,
        help="Host name or address to listen on; 127.0.0.1 for this machine only (default: "
        "all interfaces).",
    )
    g.add_argument("--port", type=int, default=8000, help="Port number (default: 8000).")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="Log level for uvicorn.",
    )
    g.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="Disable uvicorn's access log."
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    g.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help="CORS: allowed origins, as a JSON list.",
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=["*"],
        help="CORS: allowed methods, as a JSON list.",
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=["*"],
        help="CORS: allowed headers, as a JSON list.",
    )


def _add_chat_args(g: argparse._ArgumentGroup) -> None:
    """API keys and the chat template."""
    g.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="One or more keys (or env VLLM_API_KEY): /v1/*, /tokenize and /detokenize "
        "requests must send 'Authorization: Bearer <key>' with one of them.",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Chat template file, or the template itself; defaults to the tokenizer's.",
    )
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=("auto", "string", "openai"),
        help="Accepted for compatibility: the server gives the template content as "
        "OpenAI-style parts, which this model's template expects ('string' warns).",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="Role of generated messages when add_generation_prompt is true.",
    )


def _add_media_and_logging_args(g: argparse._ArgumentGroup) -> None:
    """The proxy root path, image sources, request logging, docs and metrics access."""
    g.add_argument(
        "--root-path", default=None, help="FastAPI root_path when behind a path-based proxy."
    )
    g.add_argument(
        "--allowed-local-media-path",
        default="",
        help="Allow file:// image URLs below this directory (off by default).",
    )
    g.add_argument(
        "--allowed-image-hosts",
        type=_json_list,
        default=[],
        help="Hosts, addresses or CIDRs from which image URLs may be fetched even "
        "though they are private or loopback (JSON list or comma-separated; '*' "
        "for all). Default: public addresses only. Env VLLM_ALLOWED_IMAGE_HOSTS "
        "adds to it.",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log each request's prompt and sampling parameters.",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Deprecated: request logging is off unless --enable-log-requests is given.",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Maximum number of prompt "
        "characters or token ids printed in request logs (default: unlimited).",
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Disable /docs, /redoc and /openapi.json.",
    )
    g.add_argument(
        "--enable-metrics-auth",
        action="store_true",
        help="With --api-key, /metrics requires the key too (default: open for scrapers). "
        "/tokenize and /detokenize always require it.",
    )

def _add_tls_args(g: argparse._ArgumentGroup) -> None:
    """TLS, and client certificates checked against a CA (uvicorn's options)."""
    g.add_argument("--ssl-keyfile", default=None, help="SSL key file.")
    g.add_argument("--ssl-certfile", default=None, help="SSL certificate file.")
    g.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates file that client certificates "
        "are checked against."
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=SSL_CERT_REQS,
        help="Client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's "
        "ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED).",
    )


def _add_upstream_only_args(g: argparse._ArgumentGroup) -> None:
    """Upstream server flags for what this server does not have or need (checked by
    ``check_upstream_only_flags``)."""
    g.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="Accepted: the API server and the engine already run in one process.",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="Not supported (an error): LoRA adapters are not implemented.",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Let the model choose when to call tools (tool_choice 'auto'; needs "
        "--tool-call-parser).",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="How tool calls are read from the model's output: llama3_json (the Llama 3 "
        "JSON tool-call format).",
    )


def show_defaults(group: argparse._ArgumentGroup) -> None:
    """Appends ``(default: X)`` to the help of each flag in ``group`` that does not say it."""
    for action in group._group_actions:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text.lower():
            continue
        shown = action.default
        if isinstance(shown, list):
            shown = json.dumps(shown)
        action.help = f"{text} (default: {shown})"


# (flag, type, default, help) of the server limits; docs/security.md lists every limit.
_LIMIT_FLAGS: tuple[tuple[str, type, object, str], ...] = (
    ("--max-request-body-bytes", int, None,
     "Requests whose body is larger (counted as received, whatever the headers say) get a "
     "413 (default: env VLLM_MAX_REQUEST_BODY_BYTES, else 32 MiB)."),
    ("--shutdown-timeout", float, 0.0,
     "On SIGTERM or Ctrl-C, seconds that in-flight requests may take to finish before they "
     "are aborted with an error (default 0: abort at once); new connections are refused "
     "meanwhile. The process exits with status 0."),
    ("--chat-template-max-steps", int, 1_000_000,
     "Steps (loop iterations, calls, lookups, operators) one chat template render may take."),
    ("--chat-template-max-chars", int, 4 << 20,
     "Largest string, and output, a chat template render may build, in characters (4 Mi)."),
    ("--chat-template-timeout", float, 2.0,
     "Seconds one chat template render may run; it is stopped from inside."),
    ("--max-image-pixels", int, None,
     "Largest image, in decoded pixels (default 16 Mi, or env VLLM_IMAGE_MAX_PIXELS if "
     "lower); a JPEG far larger than the model uses is decoded at a reduced scale first."),
    ("--image-decode-concurrency", int, 2, "Images decoded at the same time; others wait."),
    ("--image-fetch-timeout", float, None,
     "Seconds for one image URL in all: DNS, redirects and the body (default: env "
     "VLLM_IMAGE_FETCH_TIMEOUT, else 5)."),
    ("--image-fetch-request-timeout", float, 10.0,
     "Seconds for all the images of one request."),
    ("--max-logprob-entries", int, 1 << 18,
     "Logprob entries one response may carry: n x max_tokens x (top_logprobs + 1), plus "
     "prompt tokens x (prompt_logprobs + 1)."),
    ("--max-queued-requests", int, 1024,
     "Requests that may wait for the engine; beyond, a 503 with Retry-After."),
    ("--max-queued-images", int, 256,
     "Images that waiting requests may hold (decoded and tiled, in memory); beyond, a 503 "
     "with Retry-After."),
    ("--limit-concurrency", int, 2048,
     "Open connections the server keeps; one beyond is closed at once, and a request "
     "arriving at the limit gets a 503."),
    ("--timeout-keep-alive", float, 5.0, "Seconds an idle keep-alive connection stays open."),
    ("--header-timeout", float, 10.0,
     "Seconds a connection may take to send a request's headers; then it is closed."),
    ("--body-timeout", float, 60.0,
     "Seconds a request may take to send its body; then a 408."),
)


def add_server_limit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What one request (or connection) may cost the server."""
    g = parser.add_argument_group("server limits")
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a chat_template sent in a request (default: such requests get a 400). "
        "Every template renders under the chat-template budget either way.",
    )
    for flag, kind, default, text in _LIMIT_FLAGS:
        shown = "" if default is None or "default" in text else f" (default {default})"
        g.add_argument(flag, type=kind, default=default, help=text + shown)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Post-parse fixes and checks (raises ValueError with a message for the user)."""
    resolve_model_tag(args)
    if args.model is None:
        args.model = EngineArgs.model
    if args.api_key is None and envs.VLLM_API_KEY:
        args.api_key = [envs.VLLM_API_KEY]
    if isinstance(args.api_key, str):
        args.api_key = [args.api_key]
    check_ssl_args(args)
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests conflict.")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError("--max-log-len must be non-negative")
    check_upstream_only_flags(args)


def check_upstream_only_flags(args: argparse.Namespace) -> None:
    """Upstream server flags for what this server does not have: refused, or accepted with a
    message that says why nothing changes (docs/compatibility.md lists them)."""
    if args.lora_modules:
        raise ValueError("--lora-modules: LoRA adapters are not supported by this engine.")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (llama3_json).")
    if args.chat_template_content_format == "string":
        logger.warning(
            "--chat-template-content-format string is not applied by the server: this "
            "model's chat template reads content as OpenAI-style parts, which it is given."
        )
    if args.disable_frontend_multiprocessing:
        logger.info(
            "--disable-frontend-multiprocessing: accepted; the API server and the engine "
            "already run in one process."
        )


def check_ssl_args(args: argparse.Namespace) -> None:
    """The TLS flags name readable files, and client-certificate checks need TLS."""
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        value = getattr(args, flag)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"--{flag.replace('_', '-')}: {value} is not a readable file")
    if (args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (TLS)")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check clients against")


def ssl_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from the server flags."""
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }
