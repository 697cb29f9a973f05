"""The fused (Triton) kernels on CPU, for the bounds-checked Triton interpreter."""

from __future__ import annotations


def use_fused_kernels(monkeypatch, num_sms: int = 132) -> None:
    """Engines and models loaded after this call choose the fused Triton kernels on CPU (run
    in Triton's interpreter) and the Triton attention back-end, which splits cross prefills as
    on a GPU of ``num_sms`` SMs (an H200 has 132). Undone with the monkeypatch."""
    from vllm.attention.backends.triton_attn import TritonBackend
    from vllm.model_executor.layers import kernel_target
    from vllm.worker import loaded_model

    monkeypatch.setattr(kernel_target, "uses_fused_kernels", lambda device: True)
    monkeypatch.setattr(
        loaded_model, "get_attn_backend", lambda device: TritonBackend(num_sms=num_sms)
    )
