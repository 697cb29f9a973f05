"""The decode forward's GEMM library switch: cuBLASLt inside, the caller's choice restored."""

from __future__ import annotations

import pytest
import torch

from vllm.worker.model_runner import decode_gemm_library


def test_cpu_is_untouched() -> None:
    """No CUDA device: nothing to switch (CPU builds cannot even select cuBLASLt)."""
    with decode_gemm_library(torch.device("cpu")):
        pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_switches_and_restores() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    with decode_gemm_library(torch.device("cuda")):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(ValueError), decode_gemm_library(torch.device("cuda")):
        raise ValueError("a failing step")
    assert torch.backends.cuda.preferred_blas_library() == before
