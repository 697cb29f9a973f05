"""The ``vllm`` command line: ``vllm serve`` and ``vllm bench``."""
