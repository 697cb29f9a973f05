"""``EngineArgs``: the engine's options under vLLM's names, from keyword arguments or the CLI."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vllm import envs
from vllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
from vllm.config import (
    CacheConfig,
    CompilationConfig,
    DecodingConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    resolve_dtype,
)
from vllm.engine.cli_args import add_engine_cli_args, parse_limit_mm_per_prompt
from vllm.guided_params import BACKENDS as GUIDED_DECODING_BACKENDS
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization import (
    check_quantization_flag,
    resolve_quantization,
)
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.hub import resolve_model

logger = init_logger(__name__)

CPU_DEFAULT_MAX_MODEL_LEN = 8192
# Options upstream vLLM has that change nothing here: a value other than the default is
# accepted with a warning that says why.
IGNORED_OPTIONS: dict[str, str] = {
    "swap_space": "there is no CPU swap space here; preempted requests are recomputed",
    "max_seq_len_to_capture": "every decode step runs from a CUDA graph, whatever the length "
    "of its vision tokens",
    "tokenizer_mode": "the checkpoint's fast tokenizer (tokenizer.json) is always used",
}
# Serving defaults with chunked prefill (one place to change them; benchmarks/RESULTS.md has
# the measurements, 2026-12-02, H200, 11B). 2048 tokens: on the serving benchmark's long
# prompts (2k-16k tokens) 512-token chunks reach 64% of prefill-first's throughput and 2048
# reach 102%, while on its short prompts both reach 87-89%; larger chunks lengthen the steps
# that carry them (p99 gap between tokens 154 ms at 2048 against 82 ms at 512 on short
# prompts), the cost the throughput target outranks. 8 image-layers: the encoder's own share
# of a step (~9 ms of the 11B vision tower: 40 layers over 4 tiles, ~45 ms an image), so
# images advance while prompts fill the token budget; what the budget leaves goes to the
# encoder too (``Scheduler.encoder_layer_tokens``).
DEFAULT_CHUNKED_BATCHED_TOKENS = 2048
DEFAULT_ENCODER_LAYERS_PER_STEP = 8
# Image-processor options a user may set (--mm-processor-kwargs); the tile size, resizing and
# padding are the checkpoint's, since the vision tower is built for them.
MM_PROCESSOR_OPTIONS = ("max_image_tiles", "resample", "do_convert_rgb", "do_rescale",
                        "rescale_factor", "do_normalize", "image_mean", "image_std")
# VLLM_ATTENTION_BACKEND values of upstream vLLM, accepted with a warning.
UPSTREAM_ATTENTION_BACKENDS = ("FLASH_ATTN", "XFORMERS", "FLASHINFER")


@dataclass
class EngineArgs:
    """Options accepted by ``LLM(...)`` and ``vllm serve`` (vLLM's names and defaults)."""

    model: str = "demo/mllama-tiny"
    tokenizer: str | None = None
    # Hub IDs (``transformers_utils/hub.py``): the revision of the model (and of its tokenizer
    # when --tokenizer is not given), of a separate --tokenizer, and the cache folder.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = None
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_encoder_tiles: int | None = None
    # None: the serving defaults (chunked prefill, encoder spread over steps); the offline
    # ``LLM`` class passes False (prefill first, for throughput), as vLLM picks some
    # scheduler defaults by usage context.
    enable_chunked_prefill: bool | None = None
    encoder_layers_per_step: int | None = None
    scheduling_policy: str = "fcfs"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    limit_mm_per_prompt: dict[str, int] | str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4
    hf_overrides: dict[str, Any] | None = None
    override_generation_config: dict[str, Any] | None = None
    load_format: str = "auto"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    generation_config: str = "auto"
    trust_remote_code: bool = False
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Upstream features this engine does not have: refused with a message, not ignored.
    enable_lora: bool = False
    speculative_config: dict[str, Any] | None = None
    device: str = "auto"
    max_logprobs: int = 20
    kv_cache_dtype: str = "auto"
    disable_log_stats: bool = False
    async_scheduling: bool = True
    enable_prefix_caching: bool | None = None  # None: on (``LLM`` makes it off)
    # Structured output: the grammar library, and compact JSON by default.
    guided_decoding_backend: str = "xgrammar"
    guided_decoding_disable_any_whitespace: bool = False
    # Accepted for compatibility; they do not change anything here.
    swap_space: float = 4
    max_seq_len_to_capture: int = 8192
    tokenizer_mode: str = "auto"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     positional_model: bool = False) -> argparse.ArgumentParser:
        """One flag per field (vLLM's names, help and parsing; ``vllm/engine/cli_args.py``)."""
        add_engine_cli_args(parser, dataclasses.fields(cls), positional_model)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})

    def _device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu; got {self.device!r}")
        return torch.device(self.device)

    def _check_unsupported(self) -> None:
        check_quantization_flag(self.quantization)  # the flag alone, early
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be 1 or more, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self._device().type == "cuda":
            gpus = torch.cuda.device_count()
            if gpus < self.tensor_parallel_size:  # one GPU a rank (vllm/distributed/tp_engine.py)
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} needs "
                    f"{self.tensor_parallel_size} GPUs (one a rank); {gpus} visible"
                )
        if self.pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported (one GPU per model)")
        if self.enable_lora:
            raise ValueError("LoRA adapters (enable_lora) are not supported by this engine")
        if self.speculative_config:
            raise ValueError("speculative decoding (speculative_config) is not supported by "
                             "this engine")
        for name in ("mm_processor_kwargs", "hf_overrides", "override_generation_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict (JSON object), got "
                                 f"{type(value).__name__}")
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.bfloat16)  # ValueError if unknown
        cache_gb = self.mm_processor_cache_gb
        if isinstance(cache_gb, bool) or not isinstance(cache_gb, (int, float)) \
                or not 0 <= cache_gb < float("inf"):
            raise ValueError(f"mm_processor_cache_gb must be a number >= 0 (GiB; 0 turns the "
                             f"processed-image cache off), got {cache_gb!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        self._warn_ignored()

    def _warn_ignored(self) -> None:
        """Nothing a user sets is dropped silently: options that change nothing here say so."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, why in IGNORED_OPTIONS.items():
            value = getattr(self, name)
            if value != defaults[name]:
                logger.warning("Ignoring %s=%r: %s.", name, value, why)
        backend = envs.VLLM_ATTENTION_BACKEND
        if backend in UPSTREAM_ATTENTION_BACKENDS:
            logger.warning(
                "VLLM_ATTENTION_BACKEND=%s names an upstream vLLM back-end; this engine runs "
                "its own attention instead: Triton kernels on CUDA (torch SDPA for prefill), "
                "torch SDPA on CPU.", backend)

    def _mm_processor_kwargs(self, max_tiles: int) -> dict[str, Any]:
        """The image-processor options, checked (raises ValueError naming the option)."""
        kwargs = dict(self.mm_processor_kwargs or {})
        unknown = sorted(set(kwargs) - set(MM_PROCESSOR_OPTIONS))
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unsupported option(s) {unknown}; this "
                             f"model's image processor takes {', '.join(MM_PROCESSOR_OPTIONS)}")
        tiles = kwargs.get("max_image_tiles", max_tiles)
        if isinstance(tiles, bool) or not isinstance(tiles, int) or not 1 <= tiles <= max_tiles:
            raise ValueError(f"mm_processor_kwargs: max_image_tiles must be an integer in "
                             f"1..{max_tiles} (the model's max_num_tiles), got {tiles!r}")
        return kwargs

    def create_engine_config(self) -> VllmConfig:
        """Validates the arguments and builds the frozen configuration (raises ValueError or
        OSError with a message for the user)."""
        self._check_unsupported()
        device = self._device()
        model_config = self._model_config(device)
        sched = self._scheduler_config(model_config.max_model_len,
                                       model_config.limit_images_per_prompt,
                                       model_config.spec.vision.max_num_tiles)
        self._log_device(model_config, device)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     kv_cache_dtype=self.kv_cache_dtype),
            scheduler_config=sched,
            compilation_config=CompilationConfig(cuda_graph_sizes=self._graph_sizes(sched)),
            parallel_config=ParallelConfig(self.tensor_parallel_size,
                                           self.pipeline_parallel_size),
            device_config=DeviceConfig(device),
            decoding_config=self._decoding_config(),
        )

    def _decoding_config(self) -> DecodingConfig:
        backend = self.guided_decoding_backend.split(":", 1)[0]
        if backend not in GUIDED_DECODING_BACKENDS:
            raise ValueError(f"guided_decoding_backend={self.guided_decoding_backend!r} is not "
                             f"available; this engine serves {', '.join(GUIDED_DECODING_BACKENDS)}"
                             " (auto is xgrammar)")
        return DecodingConfig(
            guided_decoding_backend="xgrammar",
            disable_any_whitespace=self.guided_decoding_disable_any_whitespace)

    def _model_config(self, device: torch.device) -> ModelConfig:
        """The checkpoint (resolved to a folder, downloaded if need be) and how to run it."""
        path = resolve_model(self.model, revision=self.revision, download_dir=self.download_dir,
                             weights=self.load_format != "dummy", token=self.hf_token)
        tok_path = path
        if self.tokenizer and self.tokenizer != self.model:
            tok_path = resolve_model(self.tokenizer, revision=self.tokenizer_revision,
                                     download_dir=self.download_dir, weights=False,
                                     token=self.hf_token)
        spec = load_mllama_config(path, self.hf_overrides)
        quantization = resolve_quantization(self.quantization, self.load_format,
                                            spec.quantization)
        limits = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        served = self.served_model_name
        if isinstance(served, list):
            served = served[0] if served else None
        return ModelConfig(
            model=self.model, model_path=path, tokenizer_path=tok_path, spec=spec,
            dtype=resolve_dtype(self.dtype, spec.torch_dtype, device),
            max_model_len=self._max_model_len(spec.text.max_position_embeddings, device),
            served_model_name=served or self.model,
            load_format=self.load_format, seed=self.seed if self.seed is not None else 0,
            enforce_eager=self.enforce_eager, limit_images_per_prompt=limits.get("image", 1),
            generation_config=self.generation_config, max_logprobs=self.max_logprobs,
            quantization=quantization, revision=self.revision,
            tokenizer=self.tokenizer or self.model,
            mm_processor_kwargs=self._mm_processor_kwargs(spec.vision.max_num_tiles),
            mm_processor_cache_gb=float(self.mm_processor_cache_gb),
            override_generation_config=dict(self.override_generation_config or {}))

    def _graph_sizes(self, sched: SchedulerConfig) -> tuple[int, ...]:
        sizes = tuple(sorted(set(self.cuda_graph_sizes or ())))
        if any(s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {list(sizes)}")
        if sizes and sizes[-1] < sched.max_num_seqs:
            logger.info("Adding decode graph size %d to cover max_num_seqs",
                        sched.max_num_seqs)
            sizes = (*sizes, sched.max_num_seqs)
        return sizes or CompilationConfig.default_sizes(sched.max_num_seqs)

    def _log_device(self, mc: ModelConfig, device: torch.device) -> None:
        """The start-up log says what runs where, and which memory setting applies."""
        dtype = str(mc.dtype).removeprefix("torch.")
        logger.info("Model %s: %s weights and activations on %s (--dtype %s; checkpoint %s)",
                    mc.model, dtype, device.type, self.dtype, mc.spec.torch_dtype)
        if device.type == "cpu":
            logger.info("CPU: --gpu-memory-utilization (%g) does not apply; the KV cache holds "
                        "what the scheduler can use, at most %d GiB", self.gpu_memory_utilization,
                        CacheConfig.cpu_kv_cache_space_bytes >> 30)

    def _max_model_len(self, config_max: int, device: torch.device) -> int:
        if self.max_model_len is not None:
            if not 1 < self.max_model_len <= config_max:
                raise ValueError(f"max_model_len must be in 2..{config_max} (the model's "
                                 f"max_position_embeddings), got {self.max_model_len}")
            return self.max_model_len
        if device.type == "cpu" and config_max > CPU_DEFAULT_MAX_MODEL_LEN:
            logger.info("CPU device: defaulting max_model_len to %d", CPU_DEFAULT_MAX_MODEL_LEN)
            return CPU_DEFAULT_MAX_MODEL_LEN
        return config_max

    def _scheduler_config(self, max_model_len: int, limit_images: int,
                          max_tiles: int) -> SchedulerConfig:
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else 256
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = (DEFAULT_CHUNKED_BATCHED_TOKENS if chunked
                       else max(max_model_len, 8192))
        elif not chunked and batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len "
                f"({max_model_len}); without chunked prefill prompts are prefilled whole, so "
                "raise --max-num-batched-tokens, lower --max-model-len or "
                "--enable-chunked-prefill")
        if batched < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be at least "
                             f"max_num_seqs ({max_num_seqs}): every decode token counts")
        tiles = self.max_num_encoder_tiles
        if tiles is None:
            tiles = max(limit_images, 4) * max_tiles
        elif tiles < limit_images * max_tiles:
            raise ValueError(
                f"max_num_encoder_tiles ({tiles}) cannot encode one request with "
                f"{limit_images} image(s) of {max_tiles} tiles; raise it or lower "
                "--limit-mm-per-prompt")
        layers = self.encoder_layers_per_step
        if layers is None:
            layers = DEFAULT_ENCODER_LAYERS_PER_STEP if chunked else 0
        if layers < 0:
            raise ValueError(f"encoder_layers_per_step must be >= 0, got {layers}")
        if 0 < layers < limit_images:
            raise ValueError(f"encoder_layers_per_step ({layers}) must be 0 or at least the "
                             f"images per prompt ({limit_images}): a step runs at least one "
                             "encoder layer over all of a request's images")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got "
                             f"{self.scheduling_policy!r}")
        return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                               max_model_len=max_model_len, max_num_encoder_tiles=tiles,
                               enable_chunked_prefill=chunked, encoder_layers_per_step=layers,
                               scheduling_policy=self.scheduling_policy,
                               enable_prefix_caching=self.enable_prefix_caching is not False)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of :class:`~vllm.engine.async_llm_engine.AsyncLLMEngine`;
    the same fields here (the server's request-logging flags are server flags)."""
