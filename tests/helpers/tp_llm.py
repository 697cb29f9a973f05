"""The tiny model's ``LLM`` over ``tp`` tensor-parallel ranks, as the TP engine tests build it."""

from __future__ import annotations

from vllm import LLM


def tp_llm(tp: int, **kw) -> LLM:
    args = dict(
        model="demo/mllama-tiny",
        tensor_parallel_size=tp,
        max_model_len=256,
        max_num_seqs=8,
        limit_mm_per_prompt={"image": 2},
    )
    args.update(kw)
    return LLM(**args)
