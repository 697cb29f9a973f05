"""A vLLM-compatible inference engine for Llama 3.2 Vision (``MllamaForConditionalGeneration``)."""

from vllm.version import __version__

__all__ = ["__version__"]
