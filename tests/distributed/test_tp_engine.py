"""The engine over two tensor-parallel ranks on CPU (gloo; rank 0's engine starts the other
rank's process): its outputs against one rank's (check_logprobs_close), eager and on the CPU
graph path, with images, through preemption and an abort; a rank that exits fails the next
call with an error naming it instead of hanging the engine."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.server_process import free_port, stop, wait_healthy
from helpers.tp_llm import tp_llm
from helpers.tp_worker import write_wide_tiny
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.distributed.tp_engine import TensorParallelError
from vllm.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompts(k: int) -> list:
    out: list = []
    for i in range(k):
        if i % 3 == 0:
            out.append(f"Text prompt number {i} talks about")
        elif i % 3 == 1:
            out.append(
                {
                    "prompt": f"<|image|><|begin_of_text|>Image {i} shows",
                    "multi_modal_data": {"image": _image(30 + 20 * (i % 4), 60, i)},
                }
            )
        else:
            out.append(
                {
                    "prompt": f"<|begin_of_text|>Between <|image|> and <|image|>, {i} is",
                    "multi_modal_data": {"image": [_image(56, 112, i), _image(60, 60, i + 1)]},
                }
            )
    return out


PROMPTS = _prompts(9)


def _llm(tp: int, **kw) -> LLM:
    # The gloo ranks on any machine (GPU ranks: test_tp_gpu.py).
    return tp_llm(tp, **{"enforce_eager": True, "device": "cpu", **kw})


@pytest.fixture(scope="module")
def one_rank() -> list:
    return vllm_greedy(_llm(1).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_two_ranks_generate_what_one_does(one_rank: list, eager: bool) -> None:
    llm = _llm(2, enforce_eager=eager)
    try:
        assert llm.llm_engine._ranks is not None  # a second process holds half the model
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    check_logprobs_close(one_rank, vllm_greedy(out), "one rank", "two ranks")
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)


def test_two_ranks_with_fp8_weights_generate_what_one_does() -> None:
    """``--quantization fp8`` with two ranks: each quantizes its slice as it loads (whole rows
    for the row-parallel matrices), on the CPU graph path."""
    one = vllm_greedy(_llm(1, quantization="fp8").generate(PROMPTS[:6], GREEDY, use_tqdm=False))
    llm = _llm(2, quantization="fp8", enforce_eager=False)
    try:
        out = llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    check_logprobs_close(one, vllm_greedy(out), "one rank", "two ranks")


def test_two_ranks_with_nf4_weights_generate_what_one_does(tmp_path) -> None:
    """``--quantization bitsandbytes`` with two ranks (a tiny model wide enough for one block
    a rank): each rank quantizes every split matrix whole and keeps its part, with float32
    block scales; on the CPU graph path."""
    folder = str(write_wide_tiny(tmp_path / "wide"))
    kw = dict(model=folder, quantization="bitsandbytes")
    one = vllm_greedy(_llm(1, **kw).generate(PROMPTS[:6], GREEDY, use_tqdm=False))
    llm = _llm(2, enforce_eager=False, **kw)
    try:
        out = llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    check_logprobs_close(one, vllm_greedy(out), "one rank", "two ranks")


def test_two_ranks_sample_what_one_does() -> None:
    """Random sampling: a seeded request draws the same tokens on two ranks as on one (its
    generators, the same logits to float rounding); unseeded ones get a seed from rank 0, so
    the ranks' draws agree and the engine runs on."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, n=2)
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    one = _llm(1).generate(PROMPTS[:3], seeded, use_tqdm=False)
    llm = _llm(2)
    try:
        two = llm.generate(PROMPTS[:3], seeded, use_tqdm=False)
        unseeded = llm.generate(PROMPTS[:3], free, use_tqdm=False)
        again = llm.generate(PROMPTS[:3], seeded, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    tokens = [[list(c.token_ids) for c in o.outputs] for o in one]
    assert tokens == [[list(c.token_ids) for c in o.outputs] for o in two]
    assert tokens == [[list(c.token_ids) for c in o.outputs] for o in again]
    assert all(len(o.outputs[0].token_ids) == 12 for o in unseeded)


def test_two_ranks_through_preemption_and_an_abort(one_rank: list) -> None:
    """32 pages of 16 tokens for 9 requests (up to 3 self pages each, plus cross pages):
    the replicas preempt and recompute in step, and an abort mid-run reaches both."""
    llm = _llm(2, num_gpu_blocks_override=32)
    engine = llm.llm_engine
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        engine.add_request("aborted", "A request that never finishes", GREEDY)
        done: dict = {}
        for step in range(500):
            if not engine.has_unfinished_requests():
                break
            if step == 3:
                engine.abort_request("aborted")
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert engine.scheduler.num_preemptions > 0
        assert "aborted" not in done
        out = [done[str(i)] for i in range(len(PROMPTS))]
        engine.check_integrity()
    finally:
        engine.shutdown()
    check_logprobs_close(one_rank, vllm_greedy(out), "one rank", "two ranks, tight")


def test_a_rank_that_exits_fails_the_next_call() -> None:
    llm = _llm(2)
    ranks = llm.llm_engine._ranks
    try:
        ranks.procs[0].kill()
        ranks.procs[0].join(30)
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_a_rank_that_dies_inside_a_step_fails_it_by_name() -> None:
    """The step's collective fails as soon as the peer's connection closes (no hang), and
    the error names the rank that died."""
    llm = _llm(2)
    engine = llm.llm_engine
    proc = engine._ranks.procs[0]
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        engine.add_request("r", "Hello", params)
        for _ in range(3):
            engine.step()
        proc.kill()  # mid-run: the next steps' collectives meet a closed peer
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            for _ in range(200):
                engine.step()
    finally:
        engine.shutdown()


def test_vllm_serve_with_two_ranks() -> None:
    """``vllm serve -tp 2``: an image chat answered (6 greedy tokens), and a clean exit on
    SIGINT with the second rank stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "demo/mllama-tiny"]
    cmd += ["-tp", "2", "--device", "cpu", "--port", str(port), "--max-model-len", "256"]
    cmd += ["--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": ""},
    )
    buf = io.BytesIO()
    _image(64, 48, 3).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
    body = {
        "model": "demo/mllama-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    finally:
        code = stop(proc)
    assert code == 0


def test_tensor_parallel_size_is_checked() -> None:
    with pytest.raises(ValueError, match="1 or more"):
        EngineArgs(model="demo/mllama-tiny", tensor_parallel_size=0).create_engine_config()
