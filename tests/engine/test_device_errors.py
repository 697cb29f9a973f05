"""A failed GPU ends the engine with a named error, never a failure pinned on one request; and
a configuration that cannot fit is refused before anything is loaded."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.errors import DeviceError, is_device_error
from vllm.worker.memory import (
    GiB,
    check_device_memory,
    prefill_activation_estimate,
    weight_bytes,
)

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_device_errors_are_told_from_request_errors() -> None:
    assert is_device_error(RuntimeError(ILLEGAL_ACCESS))
    assert is_device_error(
        RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    )
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_error(DeviceError("x"))
    assert not is_device_error(ValueError("top_p must be in (0, 1]"))
    assert not is_device_error(RuntimeError("shape mismatch"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_a_device_failure_in_a_step_raises_device_error(where: str) -> None:
    """Fault injected at the engine loop: the step's launch fails as a dead GPU makes it fail
    (the request's own sampling inputs, rebuilt to find a culprit, fail the same way)."""
    llm = LLM(model="demo/mllama-tiny", max_model_len=128, max_num_seqs=2)
    runner = llm.llm_engine.runner
    launch, check = runner.launch, runner.check_sampling
    calls = {"n": 0}

    def failing_launch(out):
        calls["n"] += 1
        has_prefill = bool(out.chunks)
        if has_prefill == (where == "prefill") and (where == "prefill" or calls["n"] >= 3):
            raise RuntimeError(ILLEGAL_ACCESS)
        return launch(out)

    def failing_check(seqs):
        raise RuntimeError(ILLEGAL_ACCESS)

    runner.launch, runner.check_sampling = failing_launch, failing_check
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(DeviceError, match="illegal memory access") as info:
        llm.generate(["one request", "another one"], params, use_tqdm=False)
    assert isinstance(info.value.__cause__, RuntimeError)
    runner.launch, runner.check_sampling = launch, check
    # A request's own bad input still fails that request alone (not a device error).
    assert not is_device_error(ValueError("bad"))


def test_configurations_that_cannot_fit_are_refused_up_front() -> None:
    cfg = EngineArgs(
        model="demo/mllama-tiny", max_model_len=256, max_num_batched_tokens=4096
    ).create_engine_config()
    weights, acts = weight_bytes(cfg), prefill_activation_estimate(cfg)
    assert weights > 0 and acts > 0
    util = cfg.cache_config.gpu_memory_utilization
    with pytest.raises(ValueError, match="weights alone need"):
        check_device_memory(cfg, int(weights / util * 0.9))
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        check_device_memory(cfg, int((weights + acts / 2) / util))
    check_device_memory(cfg, int((weights + acts) / util) + GiB)


def test_weight_bytes_counts_the_model() -> None:
    cfg = EngineArgs(model="demo/mllama-tiny", max_model_len=256).create_engine_config()
    model = LLM(model="demo/mllama-tiny", max_model_len=256).llm_engine.runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(cfg) == params + buffers
