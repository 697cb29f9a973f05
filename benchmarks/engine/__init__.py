"""End-to-end benchmarks of the engine in-process: ``python -m benchmarks.engine COMMAND``."""
