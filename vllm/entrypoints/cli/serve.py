"""``vllm serve MODEL [flags]``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from vllm.entrypoints.openai.cli_args import make_arg_parser


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server for a Llama 3.2 Vision checkpoint "
        "(a local Hugging Face folder or a built-in demo name such as demo/mllama-tiny).",
        usage="vllm serve [MODEL] [options]",
    )
    make_arg_parser(parser, positional_model=True)
    add_server_limit_args(parser)
    parser.set_defaults(dispatch=cmd)


def add_server_limit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--max-request-body-bytes`` and ``--shutdown-timeout`` (read by ``run_server``)."""
    g = parser.add_argument_group("server limits")
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="Requests with a larger body get a 413 "
        "(default: env VLLM_MAX_REQUEST_BODY_BYTES, else 32 MiB).",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="On SIGTERM or Ctrl-C, seconds that in-flight requests may take to finish before "
        "they are aborted with an error (default 0: abort at once); new connections are "
        "refused meanwhile. The process exits with status 0.",
    )
    return parser


def cmd(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.api_server import run_server

    run_server(args)
