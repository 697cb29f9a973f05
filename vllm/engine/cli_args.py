"""Command-line flags for every :class:`~vllm.engine.arg_utils.EngineArgs` field.

Flags use vLLM's names (``--max-model-len``); :class:`FlexibleArgumentParser` (``arg_parsing``)
also accepts the spellings and forms real launch scripts use (``--max_model_len``, dotted
dictionary keys, ``--config FILE.yaml``, ``32k``). Each EngineArgs field becomes a flag: the ones
in ``_FLAG_SPECS`` get vLLM's help text, choices and parsing, and any field added later gets a
flag derived from its default value, so the CLI never falls behind. Help shows each flag's
effective default (``default_text`` where the field's ``None`` is resolved later).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from vllm.engine.arg_parsing import (
    FlexibleArgumentParser,
    MergeDictAction,
    human_readable_int,
    json_dict_type,
    normalize_flag_spelling,
)

__all__ = ["FlexibleArgumentParser", "normalize_flag_spelling", "add_engine_cli_args"]

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy", "bitsandbytes")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e5m2", "fp8_e4m3")
BLOCK_SIZE_CHOICES = (8, 16, 32, 64, 128)


def parse_limit_mm_per_prompt(value: str | dict[str, int] | None) -> dict[str, int]:
    """Accepts ``{"image": 2}`` (dict or JSON) and the older ``image=2`` form; other modalities
    (``video``, ``audio``) may be given as 0, as upstream launch scripts for several models do."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        limits = dict(value)
    else:
        try:
            limits = json.loads(value)
        except json.JSONDecodeError:
            limits = {}
            for part in value.split(","):
                key, sep, num = part.partition("=")
                if not sep:
                    raise ValueError(f"--limit-mm-per-prompt: cannot parse {value!r}; use JSON "
                                     "such as '{\"image\": 2}'") from None
                limits[key.strip()] = num.strip()
    if not isinstance(limits, dict):
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object, got {value!r}")
    out = {}
    for key, num in limits.items():
        try:
            out[key] = int(num)
        except (TypeError, ValueError):
            raise ValueError(f"--limit-mm-per-prompt: {key} must be an integer") from None
        if out[key] < 0:
            raise ValueError("--limit-mm-per-prompt: limits must be non-negative")
        if key != "image" and out[key] != 0:
            raise ValueError(
                f"--limit-mm-per-prompt: this model takes images only, so {key} must be 0 "
                f"(got {out[key]})"
            )
    return out


def limit_mm_type(value: str) -> dict[str, int]:
    """argparse type for ``--limit-mm-per-prompt``: JSON (``{"image": 2}``) or ``image=2``."""
    try:
        return parse_limit_mm_per_prompt(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list_type(value: str) -> list[int]:
    """argparse type for one item of an int list: ``8`` or ``1,2,4`` (or a JSON list)."""
    text = value.strip()
    try:
        items = json.loads(text) if text.startswith("[") else text.split(",")
        return [int(str(v).strip()) for v in items if str(v).strip()]
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected integers, got {value!r}") from None


class _FlattenIntLists(argparse.Action):
    """Stores ``--cuda-graph-sizes 1 2 4`` and ``--cuda-graph-sizes 1,2,4`` as ``[1, 2, 4]``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, [v for chunk in values for v in chunk])


# Help, type and choices for each field; flags use vLLM's names (the field name, dashed).
_FLAG_SPECS: dict[str, dict[str, Any]] = {
    "model": {
        "help": "A Hugging Face hub model ID (meta-llama/Llama-3.2-11B-Vision-Instruct: "
        "downloaded, or read from the hub cache when offline), a local checkpoint folder, or "
        "a built-in demo name such as demo/mllama-tiny."
    },
    "tokenizer": {
        "help": "Tokenizer folder or hub ID.",
        "default_text": "the model's, at its --revision",
    },
    "revision": {
        "help": "Hub branch, tag or commit of the model (a hub ID only; local folders and demo "
        "names have none).",
        "default_text": "the repository's main branch",
    },
    "tokenizer_revision": {
        "help": "Hub branch, tag or commit of a separate --tokenizer.",
        "default_text": "its main branch",
    },
    "hf_token": {
        "help": "Hub token for gated or private models.",
        "default_text": "huggingface_hub's: HF_TOKEN, else a saved login",
    },
    "download_dir": {
        "help": "Folder of the hub cache that models are downloaded into and read from.",
        "default_text": "huggingface_hub's: HF_HUB_CACHE, else $HF_HOME/hub",
    },
    "served_model_name": {
        "nargs": "+",
        "help": "Model name(s) used in the API. The first "
        "name is used in responses and in the metrics' model_name label.",
        "default_text": "the --model name (a hub ID, folder or demo name)",
    },
    "dtype": {
        "choices": DTYPE_CHOICES,
        "help": "Weight and activation dtype. auto: the "
        "checkpoint's for fp16/bf16 checkpoints; fp16 for fp32 ones on CUDA.",
    },
    "seed": {"type": int, "help": "Random seed."},
    "max_model_len": {
        "type": human_readable_int,
        "help": "Model context length (prompt plus output), e.g. 4096, 32k (32000) or 32K "
        "(32768).",
        "default_text": "the model's max_position_embeddings; 8192 on CPU",
    },
    "max_num_seqs": {
        "type": int,
        "help": "Maximum number of sequences per iteration.",
        "default_text": "256",
    },
    "max_num_batched_tokens": {
        "type": int,
        "help": "Maximum number of tokens per iteration, decode and prefill together. With "
        "chunked prefill a longer prompt is prefilled over several iterations; without, it "
        "must be at least --max-model-len (prompts are prefilled whole).",
        "default_text": "512 with chunked prefill, else max(--max-model-len, 8192)",
    },
    "max_num_encoder_tiles": {
        "type": int,
        "help": "Maximum number of image tiles whose vision tokens one iteration's prefill "
        "carries (and encodes, when --encoder-layers-per-step is 0).",
        "default_text": "max tiles per image x max(images per prompt, 4)",
    },
    "enable_chunked_prefill": {
        "action": argparse.BooleanOptionalAction,
        "help": "Prefill a prompt over several iterations within --max-num-batched-tokens, "
        "next to the decode of running requests. Off: prompts are prefilled whole, as many "
        "per iteration as the budget holds (prefill first, for throughput).",
        "default_text": "on; the offline LLM class: off",
    },
    "encoder_layers_per_step": {
        "type": int,
        "help": "Image-layers of the vision encoder per iteration for waiting requests (one "
        "encoder layer over one image's tiles is one image-layer), plus what "
        "--max-num-batched-tokens leaves after decode and prefill at the encoder's cost in "
        "tokens; at least the images per prompt. 0: encode images whole inside the prefill.",
        "default_text": "8 with chunked prefill, else 0",
    },
    "scheduling_policy": {
        "choices": ("fcfs", "priority"),
        "help": "fcfs: requests are served in arrival order. priority: by the request's "
        "priority (lower first), then arrival.",
    },
    "gpu_memory_utilization": {
        "type": float,
        "help": "Fraction of GPU memory for the model and its KV cache (0-1]. Does not apply "
        "on CPU, where the KV cache holds what the scheduler can use.",
    },
    "enforce_eager": {
        "action": "store_true",
        "help": "Always run decode eagerly (no CUDA graphs).",
    },
    "cuda_graph_sizes": {
        "type": int_list_type,
        "nargs": "+",
        "action": _FlattenIntLists,
        "help": "Decode batch sizes to capture as CUDA graphs, e.g. '1 2 4 8' or '1,2,4,8'.",
        "default_text": "1, 2, 4, then multiples of 8 up to --max-num-seqs",
    },
    "limit_mm_per_prompt": {
        "type": limit_mm_type,
        "action": MergeDictAction,
        "help": "Items per prompt for each modality, as JSON ('{\"image\": 2}'), 'image=2' or "
        "dotted (--limit-mm-per-prompt.image 2). Other modalities may be given as 0.",
        "default_text": "one image",
    },
    "mm_processor_kwargs": {
        "type": json_dict_type,
        "action": MergeDictAction,
        "help": "Options of the checkpoint's image processor, as JSON or dotted, e.g. "
        "'{\"max_image_tiles\": 2}' (at most the model's max_num_tiles).",
    },
    "mm_processor_cache_gb": {
        "type": float,
        "help": "GiB of host memory for processed images (tiles), kept by content hash so "
        "that an image sent again is neither decoded nor tiled again; 0 turns it off.",
    },
    "hf_overrides": {
        "type": json_dict_type,
        "action": MergeDictAction,
        "help": "Values that replace the checkpoint's config.json ones, as JSON or dotted "
        "(nested objects such as text_config merge key by key).",
    },
    "override_generation_config": {
        "type": json_dict_type,
        "action": MergeDictAction,
        "help": "Sampling defaults that replace the generation config's, as JSON or dotted, "
        "e.g. '{\"temperature\": 0.5}' (with --generation-config vllm, the only defaults).",
    },
    "load_format": {
        "choices": LOAD_FORMAT_CHOICES,
        "help": "Weight format; 'dummy' "
        "initialises random weights (for profiling without weight files); 'bitsandbytes' "
        "loads with --quantization bitsandbytes.",
    },
    "block_size": {"type": int, "choices": BLOCK_SIZE_CHOICES, "help": "Tokens per KV-cache page."},
    "num_gpu_blocks_override": {
        "type": int,
        "help": "Use this many KV pages instead of the profiled number (testing).",
    },
    "generation_config": {
        "help": "'auto' applies the checkpoint's generation_config.json "
        "sampling defaults, 'vllm' ignores it, or a folder holding one."
    },
    "trust_remote_code": {
        "action": argparse.BooleanOptionalAction,
        "help": "Accepted either way: Llama 3.2 Vision needs no remote code, and none is run.",
    },
    "quantization": {
        "help": "Quantization method of the weights: 'bitsandbytes' (4-bit NF4/FP4: a "
        "pre-quantized checkpoint, or a bf16 one quantized at load), 'compressed-tensors' "
        "(an FP8 checkpoint), 'fp8' (a bf16 checkpoint quantized to FP8 per channel at load; "
        "the vision tower, projector and LM head stay in --dtype). FP8 runs weight-only: "
        "activations are not quantized. Read from config.json when absent."
    },
    "tensor_parallel_size": {
        "type": int,
        "help": "Number of tensor-parallel ranks, one process (and on CUDA one GPU) each.",
    },
    "pipeline_parallel_size": {
        "type": int,
        "help": "Number of pipeline stages (1 is supported).",
    },
    "enable_lora": {
        "action": "store_true",
        "help": "Not supported (an error): LoRA adapters are not implemented.",
    },
    "speculative_config": {
        "type": json_dict_type,
        "help": "Not supported (an error): speculative decoding is not implemented.",
    },
    "device": {"choices": ("auto", "cuda", "cpu"), "help": "Device to run on."},
    "max_logprobs": {"type": int, "help": "Maximum logprobs / top_logprobs a request may ask for."},
    "kv_cache_dtype": {
        "choices": KV_CACHE_DTYPE_CHOICES,
        "help": "KV cache dtype: 'auto' (the model dtype), or 'fp8' (= 'fp8_e4m3') / "
        "'fp8_e5m2': every self- and cross-attention K/V value in one byte with scale 1.0 "
        "(clamped to the format's range), which doubles the tokens the pool holds; "
        "attention reads the rounded values, prefill included.",
    },
    "disable_log_stats": {"action": "store_true", "help": "Disable the periodic stats log."},
    "swap_space": {
        "type": float,
        "help": "Accepted for compatibility, with a warning: there is no CPU swap space "
        "(preempted requests are recomputed).",
    },
    "max_seq_len_to_capture": {
        "type": int,
        "help": "Accepted for compatibility, with a warning: every decode step runs from a "
        "CUDA graph, whatever its vision length.",
    },
    "enable_prefix_caching": {
        "action": argparse.BooleanOptionalAction,
        "help": "Reuse the KV pages of earlier prompts that start with the same tokens and "
        "images, and share the cross-attention K/V of the same images (on by default for "
        "the server, off for LLM; the cache_salt request field keeps tenants apart).",
    },
    "guided_decoding_backend": {
        "help": "Library that compiles structured-output constraints (JSON schemas, regexes, "
        "choices, grammars): xgrammar ('auto' is xgrammar).",
    },
    "guided_decoding_disable_any_whitespace": {
        "action": "store_true",
        "help": "JSON constraints allow no optional whitespace (compact output).",
    },
    "tokenizer_mode": {
        "choices": ("auto", "slow", "mistral", "custom"),
        "help": "Accepted for compatibility, with a warning unless auto: the checkpoint's "
        "fast tokenizer (tokenizer.json) is always used.",
    },
}
_SHORT_FLAGS = {
    "quantization": "-q",
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
}


def _derived_spec(default: Any) -> dict[str, Any]:
    """A flag spec for a field without an entry in ``_FLAG_SPECS``, from its default."""
    if isinstance(default, bool):
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(default, (int, float)):
        return {"type": type(default)}
    return {}


def add_engine_cli_args(parser: argparse.ArgumentParser,
                        fields: Sequence[dataclasses.Field],
                        positional_model: bool = False) -> None:
    """Adds one flag per EngineArgs field (``EngineArgs.add_cli_args`` passes its fields).
    Defaults are left to EngineArgs (flags default to ``None``, and
    ``EngineArgs.from_cli_args`` skips ``None``), so the two never disagree.

    With ``positional_model`` (``vllm serve MODEL``), ``--model`` stays available as well and
    the positional value wins; the caller resolves that after parsing.
    """
    group = parser.add_argument_group("engine arguments")
    for f in fields:
        spec = dict(_FLAG_SPECS.get(f.name) or _derived_spec(f.default))
        default_text = f.default if f.default is not dataclasses.MISSING else None
        default_text = spec.pop("default_text", default_text)
        spec["help"] = f"{spec.get('help', f.name)} (default: {default_text})"
        if spec.get("action") == "store_true":
            spec["default"] = None
        flags = [f"--{f.name.replace('_', '-')}"]
        if f.name in _SHORT_FLAGS:
            flags.append(_SHORT_FLAGS[f.name])
        group.add_argument(*flags, dest=f.name, **spec)
    if positional_model:
        parser.add_argument(
            "model_tag", nargs="?", default=None, help="The model to serve (same as --model)."
        )


def resolve_model_tag(args: argparse.Namespace) -> None:
    """Folds the positional ``model_tag`` into ``args.model`` (the positional wins)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        args.model = tag
