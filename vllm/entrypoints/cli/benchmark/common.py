"""Shared pieces of the offline benchmarks: engine flags, synthetic inputs, counters, JSON.

Synthetic inputs are seeded: prompts are random token ids of an exact length with the image
tokens first, images are random RGB noise (never blank, so the vision encoder does real work
and nothing can be short-cut on constant input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm.engine.arg_utils import EngineArgs, parse_limit_mm_per_prompt

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_image_args(parser: argparse.ArgumentParser, ratio: bool = False) -> None:
    """``--num-images``/``--image-size`` (and ``--image-ratio``) for the synthetic inputs."""
    group = parser.add_argument_group("synthetic images")
    group.add_argument(
        "--num-images", type=int, default=0, help="Images per prompt (0 = text only)."
    )
    group.add_argument(
        "--image-size",
        type=int,
        default=560,
        help="Side in pixels of the square random-noise images.",
    )
    if ratio:
        group.add_argument(
            "--image-ratio",
            type=float,
            default=1.0,
            help="Fraction of requests that carry --num-images images (the rest are text only).",
        )


def check_image_args(args: argparse.Namespace) -> None:
    """Validates the image flags; errors name the flag."""
    if args.num_images < 0:
        raise ValueError(f"--num-images must be >= 0, got {args.num_images}")
    if args.image_size < 1:
        raise ValueError(f"--image-size must be >= 1, got {args.image_size}")
    ratio = getattr(args, "image_ratio", 1.0)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--image-ratio must be in [0, 1], got {ratio}")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; raises the image limit to ``--num-images`` if unset."""
    engine_args = EngineArgs.from_cli_args(args)
    num_images = getattr(args, "num_images", 0)
    limits = parse_limit_mm_per_prompt(engine_args.limit_mm_per_prompt)
    if num_images > limits.get("image", 1):
        if engine_args.limit_mm_per_prompt is not None:
            raise ValueError(
                f"--num-images {num_images} exceeds --limit-mm-per-prompt "
                f"({limits.get('image', 1)} images)"
            )
        engine_args.limit_mm_per_prompt = {"image": num_images}
    return engine_args


def make_llm(args: argparse.Namespace) -> Any:
    """Builds ``vllm.LLM`` from the engine flags."""
    from vllm.entrypoints.llm import LLM

    kwargs = dataclasses.asdict(engine_args_from(args))
    return LLM(**kwargs)


def noise_images(count: int, size: int, seed: int) -> list[Any]:
    """``count`` distinct ``size``x``size`` RGB images of uniform random noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")
        for _ in range(count)
    ]


def plain_token_ids(llm: Any) -> np.ndarray:
    """Token ids that are safe as random prompt content: no special, EOS or image ids."""
    spec = llm.llm_engine.config.model_config.spec
    tokenizer = llm.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    special.update(spec.text.eos_token_ids)
    special.add(spec.image_token_id)
    ids = np.arange(spec.text.vocab_size)
    return ids[~np.isin(ids, sorted(special))]


def token_prompt(
    rng: np.random.Generator, pool: np.ndarray, input_len: int, num_images: int, llm: Any
) -> list[int]:
    """Exactly ``input_len`` ids: ``num_images`` image tokens, BOS, then random plain ids."""
    spec = llm.llm_engine.config.model_config.spec
    if input_len <= num_images:
        raise ValueError(
            f"--input-len ({input_len}) must exceed --num-images ({num_images}): "
            "each image takes one prompt token"
        )
    head = [spec.image_token_id] * num_images
    bos = getattr(llm.get_tokenizer(), "bos_token_id", None)
    if bos is not None:
        head.append(int(bos))
    body = rng.choice(pool, size=input_len - len(head)).tolist()
    return (head + body)[:input_len]


def synthetic_prompts(
    llm: Any, images_per_prompt: Sequence[int], input_len: int, image_size: int, seed: int
) -> list[dict[str, Any]]:
    """One vLLM prompt dict per entry of ``images_per_prompt`` (token ids + noise images)."""
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(llm)
    images = iter(noise_images(sum(images_per_prompt), image_size, seed + 1))
    prompts = []
    for n in images_per_prompt:
        prompt: dict[str, Any] = {"prompt_token_ids": token_prompt(rng, pool, input_len, n, llm)}
        if n:
            prompt["multi_modal_data"] = {"image": [next(images) for _ in range(n)]}
        prompts.append(prompt)
    return prompts


def percentiles(values: Sequence[float], ps: Sequence[float]) -> dict[str, float]:
    """``{"99": value, ...}`` (keys as vLLM writes them: integers without a decimal point)."""
    arr = np.asarray(values, dtype=np.float64)
    return {_pct_key(p): float(np.percentile(arr, p)) if arr.size else math.nan for p in ps}


def _pct_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


@dataclasses.dataclass
class RunnerSnapshot:
    """A copy of the model runner's counters (``RunnerStats``) at one moment."""

    graph_replays: dict[str, int]
    eager_decode_steps: int
    prefill_steps: int
    steps: int
    host_time_s: float

    @classmethod
    def take(cls, llm: Any) -> RunnerSnapshot:
        stats = llm.llm_engine.runner.stats
        replays = {
            f"{family}/{bucket}": int(n)
            for (family, bucket), n in sorted(stats.graph_replays.items())
        }
        return cls(
            replays, stats.eager_decode_steps, stats.prefill_steps, stats.steps, stats.host_time_s
        )

    def since(self, before: RunnerSnapshot) -> RunnerSnapshot:
        """The counters accumulated between ``before`` and this snapshot."""
        replays = {k: n - before.graph_replays.get(k, 0) for k, n in self.graph_replays.items()}
        return RunnerSnapshot(
            {k: n for k, n in replays.items() if n},
            self.eager_decode_steps - before.eager_decode_steps,
            self.prefill_steps - before.prefill_steps,
            self.steps - before.steps,
            self.host_time_s - before.host_time_s,
        )

    @property
    def decode_steps(self) -> int:
        return self.steps - self.prefill_steps


def engine_info(llm: Any) -> dict[str, Any]:
    """What the engine resolved (device, dtype, lengths, graph buckets) for the JSON record."""
    cfg = llm.llm_engine.config
    runner = llm.llm_engine.runner
    graphs = runner.graphs
    return {
        "device": str(runner.device),
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "cuda_graph_sizes": list(graphs.sizes) if graphs is not None else [],
        "graphs_captured": len(graphs.graphs) if graphs is not None else 0,
        "graph_capture_time_s": graphs.capture_time_s if graphs is not None else 0.0,
    }


def decode_weight_bytes(llm: Any) -> int:
    """Bytes of weights one decode step reads: the language model without its embedding table
    (only the batch's rows of that are gathered), as stored (4-bit layers with their block
    scales, which are persistent buffers). A lower bound on bytes moved per step."""
    lm = llm.llm_engine.runner.model.language_model
    return sum(
        t.numel() * t.element_size()
        for name, t in lm.state_dict().items()
        if "embed_tokens" not in name
    )


def write_json(path: str, record: dict[str, Any]) -> None:
    """Writes ``record`` as indented JSON (NaN becomes null), creating parent folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(record), indent=2) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as JSON-friendly values (callables such as ``dispatch`` dropped)."""
    out = {}
    for key, value in vars(args).items():
        if callable(value):
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = str(value)
        out[key] = value
    return out


def check_lengths(args: Any, info: dict[str, Any]) -> None:
    """Prompt plus output must fit the engine's max_model_len."""
    if args.input_len + args.output_len > info["max_model_len"]:
        raise ValueError(
            f"--input-len + --output-len ({args.input_len + args.output_len}) "
            f"exceeds max_model_len ({info['max_model_len']})"
        )
