"""A tensor-parallel rank of the tiny model on CPU (gloo), run in a spawned process: loads its
slice of the demo checkpoint and returns the prefill logits of the given prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm.attention.backends.torch_attn import TorchBackend
from vllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader.loader import get_model
from vllm.transformers_utils.config import load_mllama_config
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch, step_images


@torch.no_grad()
def prefill_logits(
    path, processed: list, dtype: torch.dtype = torch.float32, quantization: str | None = None
) -> list:
    """[n, vocab] float32 logits per prompt, one prefill batch, under this process's group."""
    spec = load_mllama_config(path)
    model = get_model(
        spec, path, "auto", dtype, torch.device("cpu"), 4096, quantization=quantization
    )
    backend = TorchBackend()
    selfs, crosses = model.attention_layers()
    for a in (*selfs, *crosses):
        a.backend = backend
    items = [PrefillItem(p.prompt_token_ids, p, i) for i, p in enumerate(processed)]
    batch = build_prefill_batch(items, 16, 16, torch.device("cpu"))
    images = step_images(items, torch.device("cpu"))
    vision = None
    if images is not None:
        vision = model.encode_images(images.pixel_values, images.aspect_ratio_ids, images.num_tiles)
    with set_forward_context(batch.metadata):
        hidden = model(batch.input_ids, batch.positions, vision)
    real = sum(batch.metadata.seq_lens)
    logits = model.compute_logits(hidden[:real])
    return [t.clone() for t in torch.split(logits, batch.metadata.seq_lens)]


def run_rank(
    rank: int,
    size: int,
    init_method: str,
    path,
    processed: list,
    results,
    quantization: str | None = None,
) -> None:
    """One rank: joins the group, computes, puts (rank, logits or the error text)."""
    torch.set_num_threads(1)
    try:
        init_tensor_parallel(size, rank, init_method, backend="gloo", timeout_s=60)
        # As numpy arrays: pickled by value (a tensor would be shared through a file
        # descriptor that dies with this process).
        logits = prefill_logits(path, processed, quantization=quantization)
        results.put((rank, [t.numpy() for t in logits]))
    except Exception as e:  # reported to the test
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_tensor_parallel()


def write_wide_tiny(dst: Path) -> Path:
    """The tiny demo model with a text width of 128 (the demo's is 64) as a bf16 folder with
    random weights drawn as the demo's: with two ranks its row-parallel o_proj takes 64 input
    columns a rank, one bitsandbytes block."""
    from helpers.hf_runner import demo_path
    from vllm.transformers_utils.demo_checkpoints import build_demo_config, write_weights

    dst.mkdir(parents=True)
    config = build_demo_config("demo/mllama-tiny")
    config["text_config"].update(hidden_size=128, intermediate_size=256)
    (dst / "config.json").write_text(json.dumps(config))
    weights = ("config.json", "demo_checkpoint.json", "model.safetensors.index.json")
    for f in demo_path().iterdir():
        if f.suffix != ".safetensors" and f.name not in weights:
            shutil.copy(f, dst / f.name)
    write_weights(config, dst)
    return dst
