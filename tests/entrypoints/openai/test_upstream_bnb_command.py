"""The command the upstream pull request was tested with, verbatim but for the folder and port:

    vllm serve <bnb-4bit folder> --quantization="bitsandbytes" --load-format="bitsandbytes" \\
       --dtype=bfloat16 --trust_remote_code --gpu-memory-utilization=0.98 --max-model-len=9600 \\
       --max-num-seqs 4

on a tiny random mllama checkpoint quantized and saved by transformers + bitsandbytes: it starts,
logs the weight memory in the 4-bit format, and answers an image chat whose greedy text is the
offline engine's on the same folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("bitsandbytes")  # the checkpoint writer; a test dependency
from helpers.bnb_checkpoints import VARIANTS, make_checkpoint
from openai_server_utils import image_message, png_data_url
from test_upstream_serve import START_TIMEOUT_S, ServerProcess, _free_port

from vllm import LLM, SamplingParams

UPSTREAM_FLAGS = [
    '--quantization="bitsandbytes"',
    '--load-format="bitsandbytes"',
    "--dtype=bfloat16",
    "--trust_remote_code",
    "--gpu-memory-utilization=0.98",
    "--max-model-len=9600",
    "--max-num-seqs",
    "4",
]


def _shell_words(flags: list[str]) -> list[str]:
    """What a shell passes for the flags as typed (the quotes removed)."""
    return [f.replace('"', "") for f in flags]


def test_upstream_command_serves_a_transformers_bnb_folder(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "bnb", VARIANTS["nf4"])
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(folder),
           *_shell_words(UPSTREAM_FLAGS), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = ServerProcess(cmd, {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": ""})
    messages = image_message(png_data_url((96, 64)), "What is in this image?")
    try:
        server.wait_for("Application startup complete", START_TIMEOUT_S)
        server.wait_listening(port, timeout=30)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["message"]["content"]
    finally:
        code, log = server.stop()
    assert code == 0, log[-3000:]
    weights = [line for line in log.splitlines() if "Model weights:" in line]
    assert weights and "bitsandbytes 4-bit (nf4, blocksize 64, double quantization)" in weights[0]
    assert "pre-quantized checkpoint" in weights[0]
    llm = LLM(
        model=str(folder),
        quantization="bitsandbytes",
        load_format="bitsandbytes",
        dtype="bfloat16",
        max_model_len=9600,
        max_num_seqs=4,
    )
    out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))
    assert served == out[0].outputs[0].text
