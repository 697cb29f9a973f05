"""Taking the model's CUDA-only code paths on CPU (for the bounds-checked Triton interpreter)."""

from __future__ import annotations

import torch


def force_cuda_code_paths(monkeypatch, num_sms: int = 132) -> None:
    """CPU tensors report ``is_cuda`` (so the fused Triton kernels run at their call sites,
    interpreted), and the Triton back-end splits cross prefills as on a GPU of ``num_sms`` SMs
    (an H200 has 132). Undone with the monkeypatch."""
    from vllm.attention.backends.triton_attn import TritonBackend
    from vllm.attention.ops.triton_prefill import default_prefill_config, split_count

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(TritonBackend, "_cross_splits", lambda self, q, k: split_count(
        q.shape[0], q.shape[1], k.shape[0], num_sms, default_prefill_config(q.dtype)))
