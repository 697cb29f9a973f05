"""The HF transformers reference (with the Meta-parity shim), one prompt at a time.

Inputs are the token ids and processed images our engine produced, so both sides see exactly
the same prompt; the HF model then computes its own masks from them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from helpers.hf_shim import meta_parity


@lru_cache(maxsize=4)
def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def hf_inputs(token_ids: list[int], images, image_token_id: int, max_tiles: int,
              device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Model kwargs for one prompt: ids, pixels and the dense cross-attention mask HF expects."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    kw: dict = {"input_ids": torch.tensor([token_ids], device=device)}
    if images is None:
        return kw
    tiles = images.num_tiles
    masks = get_cross_attention_token_mask(token_ids, image_token_id)
    dense = convert_sparse_cross_attention_mask_to_dense([masks], [tiles], max_tiles,
                                                          len(token_ids))
    ar_mask = torch.zeros(1, len(tiles), max_tiles, dtype=torch.long)
    for i, n in enumerate(tiles):
        ar_mask[0, i, :n] = 1
    kw.update(pixel_values=images.pixel_values[None].to(device, dtype),
              aspect_ratio_ids=images.aspect_ratio_ids[None].to(device),
              aspect_ratio_mask=ar_mask.to(device),
              cross_attention_mask=torch.tensor(dense, device=device))
    return kw


@torch.no_grad()
def hf_prefill_logits(model, kwargs: dict, shim: bool = True) -> torch.Tensor:
    """All-position logits [T, V] in float32."""
    if shim:
        with meta_parity():
            return model(**kwargs).logits[0].float()
    return model(**kwargs).logits[0].float()


@torch.no_grad()
def hf_greedy_logprobs(model, kwargs: dict, max_tokens: int, num_logprobs: int
                       ) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy generation with the shim; returns tokens and top-k logprobs per step."""
    with meta_parity():
        out = model.generate(**kwargs, do_sample=False, max_new_tokens=max_tokens,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.text_config.pad_token_id)
    prompt_len = kwargs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    lps = []
    for step_logits in out.logits:
        lp = step_logits[0].float().log_softmax(-1)
        vals, ids = lp.topk(num_logprobs)
        lps.append(dict(zip(ids.tolist(), vals.tolist(), strict=True)))
    return tokens[:len(lps)], lps


def demo_path(name: str = "demo/mllama-tiny") -> Path:
    from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint

    return get_demo_checkpoint(name)


def full_size_config_folder(dst: Path, name: str) -> Path:
    """A folder with a full-size demo config (``demo/mllama-11b`` or ``demo/mllama-90b``) and
    the tiny demo's tokenizer and processor files: what config and memory checks read,
    without the real tokenizer (which needs the optional ``llama-models`` package)."""
    import json
    import shutil

    from vllm.transformers_utils.demo_checkpoints import build_demo_config

    dst.mkdir(parents=True, exist_ok=True)
    src = demo_path()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(build_demo_config(name)))
    return dst
