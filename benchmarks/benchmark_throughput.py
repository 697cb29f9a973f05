"""Benchmark offline throughput over synthetic requests (same as ``vllm bench throughput``).

The implementation lives in :mod:`vllm.entrypoints.cli.benchmark.throughput`; flags and
examples are in benchmarks/README.md.
"""

from __future__ import annotations

from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli.benchmark.throughput import add_cli_args, main

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
