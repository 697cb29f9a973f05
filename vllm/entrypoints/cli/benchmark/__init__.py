"""``vllm bench latency|throughput|serve``: vLLM's benchmark tools for this engine.

Each submodule has ``add_cli_args(parser)`` and ``main(args)``; ``benchmarks/benchmark_*.py``
are thin wrappers around the same functions.
"""
