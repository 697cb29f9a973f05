"""Errors that end the engine, and how to tell them from errors one request caused."""

from __future__ import annotations

import torch

# Messages of the errors CUDA, cuBLAS, cuDNN and Triton raise once the device has failed.
_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "Triton Error [CUDA]",
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_EXECUTION_FAILED",
)


class DeviceError(RuntimeError):
    """The accelerator failed (an illegal memory access, a device-side assert, ...). Its
    context cannot be used again, so no further step can run in this process: restart it."""


def is_device_error(error: BaseException) -> bool:
    """Whether ``error`` came from a failed device rather than from one request's inputs
    (running out of memory is neither: it is not a device failure)."""
    if isinstance(error, DeviceError):
        return True
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(
        marker in str(error) for marker in _DEVICE_ERROR_MARKERS
    )


def device_error(error: BaseException) -> DeviceError:
    """The named error for a device failure, keeping the original as its cause."""
    if isinstance(error, DeviceError):
        return error
    return DeviceError(
        f"the GPU failed ({type(error).__name__}: {error}); its CUDA context is lost, so "
        "the engine cannot run another step in this process: restart it"
    )
