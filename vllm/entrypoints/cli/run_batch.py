"""``vllm run-batch -i INPUT -o OUTPUT --model MODEL``: an OpenAI batch file, offline
(``vllm/entrypoints/openai/run_batch.py``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from vllm.entrypoints.openai.run_batch import add_cli_args

    parser = subparsers.add_parser(
        "run-batch",
        help="Run an OpenAI batch file (chat and completion requests) offline.",
        description="Run the requests of an OpenAI batch file (JSON lines) on a model and "
        "write one result line per request, in order.",
        usage="vllm run-batch -i INPUT -o OUTPUT --model MODEL [options]",
    )
    add_cli_args(parser)
    parser.set_defaults(dispatch=cmd)


def cmd(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.run_batch import main

    main(args)
