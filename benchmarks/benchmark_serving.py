"""Benchmark an OpenAI-compatible server under load (same as ``vllm bench serve``).

The implementation lives in :mod:`vllm.entrypoints.cli.benchmark.serve`; flags and
examples are in benchmarks/README.md.
"""

from __future__ import annotations

from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli.benchmark.serve import add_cli_args, main

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
