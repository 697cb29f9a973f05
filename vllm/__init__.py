"""A vLLM-compatible inference engine for Llama 3.2 Vision (``MllamaForConditionalGeneration``)."""

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.llm import LLM
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.version import __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
