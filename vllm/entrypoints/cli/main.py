"""The ``vllm`` console script: ``vllm serve MODEL [flags]``, ``vllm run-batch``, ``vllm chat``
and ``vllm complete`` (against a running server), ``vllm collect-env`` and ``vllm bench ...``."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli import collect_env, openai_client, run_batch, serve
from vllm.version import __version__

BENCH_SUBCOMMANDS = {
    "latency": "Latency of one batch of requests (offline).",
    "throughput": "Offline throughput over many requests.",
    "serve": "Online serving benchmark against a running server.",
}


def _bench_module(name: str) -> ModuleType | None:
    # Contract: each module in vllm/entrypoints/cli/benchmark/ defines
    # ``main(args: argparse.Namespace)`` and may define
    # ``add_cli_args(parser: argparse.ArgumentParser)`` for its flags; without
    # ``add_cli_args`` its arguments arrive unparsed in ``args.bench_args``.
    try:
        return importlib.import_module(f"vllm.entrypoints.cli.benchmark.{name}")
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.startswith("vllm.entrypoints.cli.benchmark"):
            return None
        raise


def _run_bench(args: argparse.Namespace) -> None:
    module = _bench_module(args.bench_type)
    if module is None or not hasattr(module, "main"):
        raise SystemExit(f"Error: `vllm bench {args.bench_type}` is not implemented yet.")
    module.main(args)


def _register_bench(subparsers: argparse._SubParsersAction, load_modules: bool) -> None:
    """Adds ``vllm bench {latency,throughput,serve}``. The benchmark modules are imported only
    when the command line asks for ``bench`` (``load_modules``), so ``vllm serve`` neither
    pays for nor depends on them."""
    bench = subparsers.add_parser(
        "bench",
        help="Benchmarks (latency, throughput, serve).",
        description="vLLM-style benchmarks.",
    )
    bench_sub = bench.add_subparsers(
        dest="bench_type", required=True, metavar="{latency,throughput,serve}"
    )
    for name, help_text in BENCH_SUBCOMMANDS.items():
        parser = bench_sub.add_parser(name, help=help_text, description=help_text)
        module = _bench_module(name) if load_modules else None
        if module is not None and hasattr(module, "add_cli_args"):
            module.add_cli_args(parser)
        else:
            parser.add_argument("bench_args", nargs=argparse.REMAINDER)
        parser.set_defaults(dispatch=_run_bench)


def make_parser(load_bench_modules: bool = False) -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(
        prog="vllm", description="vLLM-compatible CLI for Llama 3.2 Vision."
    )
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(
        dest="subcommand",
        required=True,
        metavar="{serve,run-batch,chat,complete,collect-env,bench}",
    )
    serve.register(subparsers)
    run_batch.register(subparsers)
    openai_client.register(subparsers)
    collect_env.register(subparsers)
    _register_bench(subparsers, load_bench_modules)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser(load_bench_modules=bool(argv) and argv[0] == "bench")
    args = parser.parse_args(argv)
    args.dispatch(args)


if __name__ == "__main__":
    main()
