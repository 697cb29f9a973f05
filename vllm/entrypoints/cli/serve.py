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
    parser.set_defaults(dispatch=cmd)


def cmd(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.api_server import run_server

    run_server(args)
