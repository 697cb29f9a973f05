"""The commands besides ``vllm serve``: ``run-batch`` (the OpenAI batch format, images
included, a progress bar), ``chat`` and ``complete`` against a running server,
``collect-env``, and ``bench serve`` with the random-mm and ShareGPT datasets."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai_server_utils import MODEL, RunningServer, png_data_url, wait_until_idle

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.cli import openai_client
from vllm.entrypoints.cli.benchmark import serve as bench_serve
from vllm.entrypoints.cli.main import main, make_parser
from vllm.entrypoints.openai.run_batch import run_batch

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": "", "PYTHONPATH": str(ROOT)}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


def batch_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def batch_args(*extra: str) -> argparse.Namespace:
    argv = ["run-batch", "-i", "-", "-o", "-", "--model", MODEL, "--max-model-len", "512"]
    args = make_parser().parse_args([*argv, "--disable-tqdm", *extra])
    args.api_key = args.api_key or None
    return args


def test_run_batch_lines(engine: AsyncLLMEngine, server: RunningServer) -> None:
    image_chat = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url()}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        "max_tokens": 3,
    }
    lines = [
        batch_line("chat", "/v1/chat/completions", CHAT),
        batch_line("image", "/v1/chat/completions", image_chat),
        "",
        batch_line("cmpl", "/v1/completions", {"prompt": "Once", "max_tokens": 2, "echo": True}),
        batch_line("bad", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
        "{not json",
        batch_line("embed", "/v1/embeddings", {"input": "x"}),
        batch_line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
    ]
    results = asyncio.run(run_batch(batch_args(), lines, engine))
    assert [r["custom_id"] for r in results] == [
        "chat",
        "image",
        "cmpl",
        "bad",
        None,
        "embed",
        "stream",
    ]
    ok = {r["custom_id"]: r for r in results if r["error"] is None}
    assert set(ok) == {"chat", "image", "cmpl"}
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60).json()
    body = ok["chat"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == direct["choices"][0]["message"]  # greedy: equal
    assert ok["image"]["response"]["body"]["usage"]["prompt_tokens"] > 0
    assert ok["cmpl"]["response"]["body"]["choices"][0]["text"].startswith("Once")
    for r in results:
        assert r["id"].startswith("vllm-") and r["response"]["request_id"].startswith("vllm-batch-")
    failed = {r["custom_id"]: r for r in results if r["error"] is not None}
    assert failed["bad"]["response"] == {**failed["bad"]["response"], "status_code": 400}
    assert failed["bad"]["response"]["body"] is None
    assert "max_tokens" in failed["bad"]["error"]["error"]["message"]
    assert "not valid JSON" in failed[None]["error"]["error"]["message"]
    assert "url must be one of" in failed["embed"]["error"]["error"]["message"]
    assert "stream is not supported" in failed["stream"]["error"]["error"]["message"]
    assert len({r["id"] for r in results}) == len(results)
    wait_until_idle(engine)


def test_run_batch_command(tmp_path: Path) -> None:
    """The command itself, in its own process: files in and out, the progress bar."""
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    bodies = [{**CHAT, "messages": [{"role": "user", "content": f"Hi {i}"}]} for i in range(3)]
    src.write_text(
        "\n".join(batch_line(f"r{i}", "/v1/chat/completions", b) for i, b in enumerate(bodies))
        + "\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(dst),
        "--model",
        MODEL,
        "--max-model-len",
        "512",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Running batch" in proc.stderr and "3/3" in proc.stderr
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    missing = subprocess.run(
        [*cmd[:5], str(tmp_path / "none.jsonl"), *cmd[6:]],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=ROOT,
    )
    assert missing.returncode == 1 and "cannot open" in missing.stderr


def _client_args(server: RunningServer, command: str, *extra: str) -> argparse.Namespace:
    return make_parser().parse_args([command, "--url", f"{server.url}/v1", *extra])


def test_chat_keeps_the_conversation(server: RunningServer) -> None:
    client = openai_client.Client(f"{server.url}/v1", None)
    assert client.model == MODEL  # the server's first model
    session = openai_client.Session(client, True, "Be brief.", max_tokens=3)
    out = io.StringIO()
    first = session.send("Hello", out)
    second = session.send("Again", out)
    roles = [m["role"] for m in session.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in session.messages[2::2]] == [first, second]
    assert out.getvalue() == f"{first}\n{second}\n"


def test_chat_and_complete_commands(server: RunningServer) -> None:
    out = io.StringIO()
    args = _client_args(server, "chat", "--max-tokens", "2")
    openai_client.run(args, chat=True, stdin=io.StringIO("hi\n\nthere\nexit\nnever\n"), stdout=out)
    text = out.getvalue()
    assert text.startswith(f"Using model {MODEL} at {server.url}/v1")
    assert text.count("> ") == 4  # hi, the empty line, there, exit
    out = io.StringIO()
    args = _client_args(server, "complete", "-q", "Once upon", "--max-tokens", "3")
    openai_client.run(args, chat=False, stdout=out)
    assert out.getvalue().endswith("\n") and "Using model" not in out.getvalue()
    with pytest.raises(SystemExit, match="The model `nope` does not exist"):
        main(["complete", "--url", f"{server.url}/v1", "--model-name", "nope", "-q", "x"])
    with pytest.raises(SystemExit, match="Error: "):
        main(["chat", "--url", "http://127.0.0.1:9/v1", "-q", "x"])  # nothing listens


def test_collect_env(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("VLLM_API_KEY", "top-secret-value")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    main(["collect-env"])
    text = capsys.readouterr().out
    for section in ("System", "Torch and GPUs", "Libraries", "Environment variables"):
        assert f"\n{section}\n" in f"\n{text}", section
    assert f"torch               : {torch.__version__}" in text or torch.__version__ in text
    assert "vllm (this package)" in text and "transformers" in text
    assert "VLLM_LOGGING_LEVEL" in text and "DEBUG" in text
    assert "top-secret-value" not in text and "hf_secret" not in text
    assert "VLLM_API_KEY" in text and "***" in text


def test_bench_serve_random_mm_and_sharegpt(server: RunningServer, tmp_path: Path) -> None:
    common = f"--base-url {server.url} --num-prompts 3 --disable-tqdm --max-concurrency 2"
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    mm = f"{common} --dataset-name random-mm --input-len 4 --output-len 3 --image-size 32"
    rec = bench_serve.main(parser.parse_args(mm.split()))
    assert rec["completed"] == 3 and rec["num_image_requests"] == 3
    assert rec["total_output_tokens"] == 9
    turns = [("Tell me about the weather today", "It is sunny and warm outside")] * 4
    data = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in turns
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rec = bench_serve.main(
        parser.parse_args(f"{common} --dataset-name sharegpt --dataset-path {path}".split())
    )
    answer_tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": turns[0][1], "add_special_tokens": False}
    ).json()["count"]
    assert rec["completed"] == 3 and rec["num_image_requests"] == 0
    assert rec["total_output_tokens"] == 3 * answer_tokens  # each answer's length, ignore_eos
    wait_until_idle(server.engine)


def test_bench_serve_request_rate_sweep(server: RunningServer, tmp_path: Path) -> None:
    """Several --request-rate values: one run each, one JSON with every run and a PNG."""
    from PIL import Image

    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    argv = (
        f"--base-url {server.url} --num-prompts 3 --disable-tqdm --input-len 4 "
        f"--output-len 3 --image-size 32 --request-rate 40 inf --result-dir {tmp_path} "
        "--result-filename sweep.json --metric-percentiles 90"
    ).split()
    rec = bench_serve.main(parser.parse_args(argv))
    assert rec["request_rates"] == [40.0, "inf"]
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["completed"] for r in saved["runs"]] == [3, 3]
    # Each rate sends its own prompts (seed + i), never the earlier rate's cached ones.
    assert [r["args"]["seed"] for r in saved["runs"]] == [0, 1]
    for r in saved["runs"]:  # the plotted percentiles are added to the asked ones
        assert {"p90_itl_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms"} <= set(r)
    with Image.open(tmp_path / "sweep.png") as png:
        assert png.format == "PNG" and png.width > png.height > 100
    wait_until_idle(server.engine)
