"""Where time goes, on a GPU: ``python -m benchmarks.profiling COMMAND``."""
