"""Command-line flags for every :class:`~vllm.engine.arg_utils.EngineArgs` field.

Flags use vLLM's names (``--max-model-len``); :class:`FlexibleArgumentParser` also accepts the
underscore spelling (``--max_model_len``) that real launch scripts use. Each EngineArgs field
becomes a flag: the ones in ``_FLAG_SPECS`` get vLLM's help text, choices and parsing, and any
field added later gets a flag derived from its default value, so the CLI never falls behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy", "bitsandbytes")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e5m2", "fp8_e4m3")
BLOCK_SIZE_CHOICES = (8, 16, 32, 64, 128)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that accepts ``--flag_name`` for ``--flag-name``."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(normalize_flag_spelling(args), namespace)


def normalize_flag_spelling(args: Sequence[str]) -> list[str]:
    """``--max_model_len=8`` -> ``--max-model-len=8``; values are left untouched."""
    out = []
    for arg in args:
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def parse_limit_mm_per_prompt(value: str | dict[str, int] | None) -> dict[str, int]:
    """Accepts ``{"image": 2}`` (dict or JSON) and the older ``image=2`` form."""
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
        if key != "image":
            raise ValueError(f"--limit-mm-per-prompt: unsupported modality {key!r} (only image)")
        try:
            out[key] = int(num)
        except (TypeError, ValueError):
            raise ValueError(f"--limit-mm-per-prompt: {key} must be an integer") from None
        if out[key] < 0:
            raise ValueError("--limit-mm-per-prompt: limits must be non-negative")
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
        "help": "Name or path of the Hugging Face checkpoint folder (or a built-in demo "
        "name such as demo/mllama-tiny)."
    },
    "tokenizer": {"help": "Tokenizer folder; defaults to the model's."},
    "served_model_name": {
        "nargs": "+",
        "help": "Model name(s) used in the API. The first "
        "name is used in responses and in the metrics' model_name label; "
        "defaults to --model.",
    },
    "dtype": {
        "choices": DTYPE_CHOICES,
        "help": "Weight and activation dtype. auto: the "
        "checkpoint's for fp16/bf16 checkpoints; fp16 for fp32 ones on CUDA.",
    },
    "seed": {"type": int, "help": "Random seed."},
    "max_model_len": {
        "type": int,
        "help": "Model context length (prompt plus output); defaults to the model's (8192 on CPU).",
    },
    "max_num_seqs": {"type": int, "help": "Maximum number of sequences per iteration."},
    "max_num_batched_tokens": {"type": int, "help": "Maximum number of tokens per iteration."},
    "max_num_encoder_tiles": {
        "type": int,
        "help": "Maximum number of image tiles encoded per iteration.",
    },
    "decode_interleave_tokens": {
        "type": int,
        "help": "While sequences decode, a prefill step carries at most this many prompt "
        "tokens (at least one request) and a decode step follows it, bounding the gap between "
        "two tokens of a running request. 0: prefill first, whole batches. Default 256 "
        "(the offline LLM class: 0).",
    },
    "encoder_layers_per_step": {
        "type": int,
        "help": "While sequences decode, images of waiting requests are encoded this many "
        "image-layers per decode step, ahead of their prefill. 0: encode inside the prefill. "
        "Default 4 (the offline LLM class: 0).",
    },
    "prefill_layers_per_step": {
        "type": int,
        "help": "While sequences decode (interleaved prefill), run an admitted prefill this "
        "many text layers per decode step instead of in one step, so its eager launch is "
        "spread out (a decode step runs next to each slice). 0: one step. Default 5 "
        "(the offline LLM class: 0).",
    },
    "gpu_memory_utilization": {
        "type": float,
        "help": "Fraction of GPU memory for the model and its KV cache (0-1].",
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
    },
    "limit_mm_per_prompt": {
        "type": limit_mm_type,
        "help": "Items per prompt for each "
        "modality, as JSON ('{\"image\": 2}') or 'image=2'. Defaults to "
        "one image.",
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
        "action": "store_true",
        "help": "Accepted for compatibility (Llama 3.2 Vision needs no remote code).",
    },
    "quantization": {
        "help": "Quantization method of the weights: 'bitsandbytes' (4-bit NF4/FP4: a "
        "pre-quantized checkpoint, or a bf16 one quantized at load). Read from config.json "
        "when absent."
    },
    "tensor_parallel_size": {
        "type": int,
        "help": "Number of tensor-parallel GPUs (1 is supported).",
    },
    "device": {"choices": ("auto", "cuda", "cpu"), "help": "Device to run on."},
    "max_logprobs": {"type": int, "help": "Maximum logprobs / top_logprobs a request may ask for."},
    "kv_cache_dtype": {
        "choices": KV_CACHE_DTYPE_CHOICES,
        "help": "KV cache dtype (auto is supported).",
    },
    "disable_log_stats": {"action": "store_true", "help": "Disable the periodic stats log."},
    "swap_space": {"type": float, "help": "CPU swap space per GPU in GiB (accepted, unused)."},
    "max_seq_len_to_capture": {"type": int, "help": "Accepted for compatibility."},
    "enable_prefix_caching": {
        "action": argparse.BooleanOptionalAction,
        "help": "Accepted; prefix caching is off for this model.",
    },
    "enable_chunked_prefill": {
        "action": argparse.BooleanOptionalAction,
        "help": "Accepted; prompts are prefilled whole.",
    },
    "tokenizer_mode": {"help": "Accepted for compatibility (the fast tokenizer is used)."},
    "revision": {"help": "Accepted for compatibility (local folders only)."},
    "download_dir": {"help": "Accepted for compatibility (local folders only)."},
}
_SHORT_FLAGS = {"quantization": "-q", "tensor_parallel_size": "-tp"}


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
