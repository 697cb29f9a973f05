"""Kernel microbenchmarks on a GPU: ``python -m benchmarks.kernels COMMAND``."""
