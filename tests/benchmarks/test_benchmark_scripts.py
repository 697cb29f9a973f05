"""The benchmark tools on CPU: latency and throughput on the tiny demo model in-process, the
serving benchmark's SSE client, the whole serving benchmark against a scripted loopback server
and against the real server (``vllm.entrypoints.openai.api_server``) when it exists, and the
``--smoke`` runs of ``python -m benchmarks.engine`` (report, ttft-tiles, serving-loop). The pure
serving math is in ``test_serving_metrics.py``."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli.benchmark import latency, serve, throughput
from vllm.entrypoints.cli.benchmark.serve_client import encode_payload, send_request
from vllm.entrypoints.cli.benchmark.serve_metrics import RequestResult
from vllm.entrypoints.cli.benchmark.throughput import images_per_request

TINY = (
    "--model demo/mllama-tiny --max-model-len 64 --max-num-seqs 4 --num-gpu-blocks-override 64 "
    "--disable-log-stats"
)


def parse(module: object, argv: str) -> argparse.Namespace:
    """Parses a space-separated command line with the module's ``add_cli_args``."""
    parser = FlexibleArgumentParser()
    module.add_cli_args(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv.split())


# ---------------------------------------------------------------------------- offline
def test_latency_reports_positive_numbers(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    args = parse(
        latency,
        f"{TINY} --input-len 12 --output-len 5 --batch-size 2 --num-iters-warmup 1 "
        f"--num-iters 2 --num-images 1 --image-size 40 --output-json {out}",
    )
    latency.main(args)
    rec = json.loads(out.read_text())
    for key in ("avg_latency", "avg_ttft", "output_tokens_per_second", "decode_weight_bytes"):
        assert rec[key] > 0, key
    assert all(t > 0 for t in rec["latencies"] + rec["ttft_latencies"])
    assert len(rec["latencies"]) == 2 and len(rec["ttft_latencies"]) == 2
    assert set(rec["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    # The step time is derived, not measured: on a shared CPU its sign is noise, so check the
    # derivation (the GPU run is where it means something).
    expected = 1000 * (rec["avg_latency"] - rec["avg_ttft"]) / 4
    assert rec["decode_ms_per_step"] == pytest.approx(expected)
    runner = rec["runner"]
    # 2 timed iterations x 4 decode steps, all from the cross family's bucket-2 "graph".
    assert runner["graph_replays"] == {"cross/2": 8}
    assert runner["eager_decode_steps"] == 0 and runner["decode_steps"] == 8
    assert runner["host_ms_per_decode_step"] > 0 and runner["host_ms_per_prefill_step"] > 0
    assert rec["args"]["num_images"] == 1 and rec["engine"]["max_model_len"] == 64


def test_throughput_eager_with_mixed_requests(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    args = parse(
        throughput,
        f"{TINY} --enforce-eager --num-prompts 6 --input-len 10 --output-len 4 --num-images 1 "
        f"--image-ratio 0.5 --image-size 40 --num-warmup-prompts 1 --output-json {out}",
    )
    throughput.main(args)
    rec = json.loads(out.read_text())
    for key in (
        "elapsed_time",
        "requests_per_second",
        "tokens_per_second",
        "output_tokens_per_second",
    ):
        assert rec[key] > 0, key
    assert rec["num_requests"] == 6 and rec["num_image_requests"] == 3
    assert rec["total_prompt_tokens"] == 60 and rec["total_output_tokens"] == 24
    assert rec["total_num_tokens"] == 84
    assert rec["runner"]["eager_decode_steps"] > 0 and rec["runner"]["graph_replays_total"] == 0


def test_images_per_request_is_seeded() -> None:
    a = images_per_request(10, 2, 0.3, seed=1)
    assert a == images_per_request(10, 2, 0.3, seed=1)
    assert sorted(a) == [0] * 7 + [2] * 3
    assert images_per_request(4, 0, 1.0, seed=0) == [0, 0, 0, 0]


# ---------------------------------------------------------------------------- SSE client
def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _chat_stream(n: int, prompt_tokens: int, delay: float) -> list[tuple[float, bytes]]:
    """(sleep before, bytes) pairs: role chunk, n content chunks, finish, usage, [DONE]."""
    items = [
        (0.0, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    ]
    for i in range(n):
        items.append(
            (
                delay,
                _sse(
                    {
                        "choices": [
                            {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                        ]
                    }
                ),
            )
        )
    items.append((0.0, _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})))
    items.append(
        (
            0.0,
            _sse(
                {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}}
            ),
        )
    )
    items.append((0.0, _sse("[DONE]")))
    return items


async def _replay(items: list[tuple[float, bytes]]) -> AsyncIterator[bytes]:
    for pause, data in items:
        if pause:
            await asyncio.sleep(pause)
        yield data


def test_send_request_measures_a_stream() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("model") == "bad":
            return httpx.Response(400, json={"error": {"message": "no such model"}})
        if body.get("model") == "inband":
            return httpx.Response(200, content=_replay([(0.0, _sse({"error": {"code": 500}}))]))
        return httpx.Response(200, content=_replay(_chat_stream(4, 17, 0.02)))

    async def go() -> tuple[RequestResult, RequestResult, RequestResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            url = "http://test/v1/chat/completions"
            ok = await send_request(client, url, encode_payload({"model": "m"}))
            bad = await send_request(client, url, encode_payload({"model": "bad"}))
            inband = await send_request(client, url, encode_payload({"model": "inband"}))
            return ok, bad, inband

    ok, bad, inband = asyncio.run(go())
    assert ok.success and ok.output_tokens == 4 and ok.prompt_len == 17
    assert ok.generated_text == "t0 t1 t2 t3 "
    assert ok.ttft >= 0.015  # the role chunk does not count as the first token
    assert len(ok.itl) == 4  # 3 content gaps + the finish chunk
    assert ok.latency >= ok.ttft + sum(ok.itl) - 1e-6
    assert ok.tpot == pytest.approx((ok.latency - ok.ttft) / 3)
    assert not bad.success and "HTTP 400" in bad.error
    assert not inband.success and "in-band" in inband.error


# ---------------------------------------------------------------------------- end to end
def _fake_openai_app() -> object:
    """A scripted OpenAI-compatible server: one token per chunk, 2 ms apart."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        if body["model"] != "fake-model" or body["stream"] is not True:
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        n_images = sum(1 for p in body["messages"][0]["content"] if p["type"] == "image_url")
        items = _chat_stream(body["max_tokens"], 10 + n_images, 0.002)
        return StreamingResponse(_replay(items), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])]
    )


@pytest.fixture
def fake_server() -> Iterator[str]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_openai_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _serve_args(base_url: str, tmp_path: Path, output_len: int = 6) -> argparse.Namespace:
    return parse(
        serve,
        f"--base-url {base_url} --num-prompts 8 --max-concurrency 4 --request-rate 200 "
        f"--input-len 8 --output-len {output_len} --image-ratio 0.5 --image-size 40 "
        "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result "
        f"--save-detailed --result-dir {tmp_path} --result-filename serve.json --disable-tqdm",
    )


def _check_serve_record(rec: dict, output_len: int) -> None:
    assert rec["completed"] == 8 and rec["failed"] == 0
    assert rec["total_output_tokens"] == 8 * output_len
    assert rec["num_image_requests"] == 4 and rec["total_input_tokens"] > 0
    for key in (
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p50_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "duration",
    ):
        assert rec[key] > 0, key
    assert len(rec["ttfts"]) == 8 and rec["errors"] == [""] * 8
    assert sorted(rec["num_images"]) == [0] * 4 + [1] * 4
    sends = rec["send_times"]
    # Sent in the load window (before each request's first token), at most 4 at once.
    assert all(t > 0 for t in sends) and max(sends) - min(sends) < rec["duration"]


def test_serving_benchmark_against_scripted_server(fake_server: str, tmp_path: Path) -> None:
    rec = serve.main(_serve_args(fake_server, tmp_path))
    _check_serve_record(rec, 6)
    assert rec["model_id"] == "fake-model"  # discovered from /v1/models
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["completed"] == 8 and saved["max_concurrency"] == 4


@pytest.mark.skipif(
    importlib.util.find_spec("vllm.entrypoints.openai.api_server") is None,
    reason="vllm/entrypoints/openai/api_server.py does not exist yet",
)
def test_serving_benchmark_against_real_server(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "demo/mllama-tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--num-gpu-blocks-override",
        "256",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"{base}/v1/models", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the server did not come up within 40 s")
        rec = serve.main(_serve_args(base, tmp_path, output_len=8))
        _check_serve_record(rec, 8)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_vllm_bench_cli_uses_these_modules() -> None:
    main_mod = pytest.importorskip("vllm.entrypoints.cli.main")
    # main.py loads the bench modules only for `vllm bench ...` command lines.
    params = inspect.signature(main_mod.make_parser).parameters
    parser = main_mod.make_parser(
        **({"load_bench_modules": True} if "load_bench_modules" in params else {})
    )
    args = parser.parse_args(["bench", "serve", "--num-prompts", "3", "--image-ratio", "0"])
    assert args.num_prompts == 3 and args.image_ratio == 0.0
    args = parser.parse_args(["bench", "latency", "--input-len", "7", "--max_model_len", "64"])
    assert args.input_len == 7 and args.max_model_len == 64 and args.num_iters == 30
    args = parser.parse_args(["bench", "throughput", "--num-prompts", "5"])
    assert args.num_prompts == 5 and args.image_ratio == 1.0


def _run_module(*argv: str) -> None:
    """Runs ``python -m ARGV`` from the repository root (as the README says to)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("chunked", [True, False])
def test_closed_loop_smoke(tmp_path: Path, chunked: bool) -> None:
    """python -m benchmarks.engine serving-loop on the tiny model: a JSON with ITL percentiles
    and a step trace whose steps add up to the work done, within the token budget."""
    out = tmp_path / "loop.json"
    flag = "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill"
    _run_module("benchmarks.engine", "serving-loop", "--smoke", flag,
                "--max-num-batched-tokens", "16" if chunked else "256", "--out", str(out))
    rec = json.loads(out.read_text())
    assert rec["itl_ms"]["50"] > 0 and rec["ttft_ms"]["99"] >= rec["ttft_ms"]["50"]
    assert rec["graph_replay_fraction"] == 1.0
    trace = rec["trace"]
    # 8 requests of 6 tokens: the first from each prefill, the other 5 from decode rows.
    assert sum(s["seqs"] for s in trace) == 8 * 5
    budget = 16 if chunked else 256
    assert all(s["seqs"] + s["prompt_tokens"] <= budget for s in trace)
    if chunked:  # some prompt ran over several steps (prompts of ~24 tokens > 16)
        assert sum(s["chunks"] for s in trace) > 8
        assert "mixed" in {s["kind"] for s in trace}  # decode and prefill in one step


def test_report_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.engine report --smoke (tiny model, CPU): the measurement code paths
    run and the summary carries every target's figure, including TTFT over its floors."""
    _run_module("benchmarks.engine", "report", "--smoke", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ttft_image_ms"] > 0 and summary["ttft_over_component_floors"] > 0
    assert summary["decode_bs1_text_ms"] > 0 and summary["graph_replay_fraction"] == 1.0
    assert set(summary) == {
        "decode_bs1_image_ms", "floor_cross_ms", "decode_bs1_text_ms", "floor_text_ms",
        "ttft_image_ms", "ttft_over_component_floors", "ttft_over_floors_split_padding_rows",
        "bs64_mixed_bandwidth_fraction", "graph_replay_fraction", "hf_bs1_image_ms", "copy_tb_s",
    }


def test_ttft_tiles_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.engine ttft-tiles --smoke: one prefill per canvas, and the
    processor split the canvases into 1, 2, 3 and 4 tiles as the command claims."""
    out = tmp_path / "tiles.json"
    _run_module("benchmarks.engine", "ttft-tiles", "--smoke", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["tiles"] for r in rows] == [1, 2, 3, 4]
    assert all(r["ttft_ms"] > 0 for r in rows)


def test_long_context_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.engine long-context --smoke: the no-flag engine's start-up split,
    TTFT with and without an image against a positive floor at each length, and decode at
    long context against the short step plus its KV bytes."""
    out = tmp_path / "long.json"
    _run_module("benchmarks.engine", "long-context", "--smoke", "--out", str(out))
    res = json.loads(out.read_text())
    start = res["startup_s"]
    parts = [start[k] for k in ("load", "vision graphs", "profile", "decode graphs", "warm-up")]
    assert all(v >= 0 for v in parts) and sum(parts) <= start["total"]
    assert res["max_num_batched_tokens"] < res["max_model_len"]  # chunked: the serving default
    assert [(r["tokens"], r["image"]) for r in res["ttft"]] == [
        (256, False), (256, True), (512, False), (512, True)]
    assert all(r["ttft_ms"] > 0 and r["floor_ms"] > 0 for r in res["ttft"])
    (dec,) = res["decode"]
    assert dec["ms_per_step"] > 0 and dec["floor_ms"] > res["decode_short_ms"] > 0


def test_quant_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.engine quant --smoke: bf16, load-time NF4 with an FP8 KV cache on
    the tiny model, each format's decode points and TTFT, the 4-bit linears' stored bytes
    well under bf16's, and one target row per quantized decode point."""
    out = tmp_path / "quant.json"
    _run_module("benchmarks.engine", "quant", "--smoke", "--formats", "bf16,bitsandbytes@fp8",
                "--out", str(out))
    rep = json.loads(out.read_text())
    bf16, nf4 = rep["results"]
    assert [r["format"] for r in rep["results"]] == ["bf16", "bitsandbytes@fp8"]
    assert [r["kv_cache_dtype"] for r in rep["results"]] == ["auto", "fp8"]
    for r in (bf16, nf4):
        assert [(p["mix"], p["batch"]) for p in r["decode"]] == [("text", 1), ("image", 1)]
        assert all(p["step_ms"] > 0 and p["eager"] == 0 for p in r["decode"])
        assert r["ttft_ms"] > 0
    # 4 bits + a uint8 scale per 64 weights + per-layer tables: ~0.27 of bf16 at 11B widths,
    # a little more at the tiny widths.
    ratio = nf4["bytes_image"]["linears"] / bf16["bytes_image"]["linears"]
    assert 0.25 < ratio < 0.34, ratio
    assert nf4["bytes_image"]["lm_head"] == bf16["bytes_image"]["lm_head"]
    assert [(t["mix"], t["batch"]) for t in rep["targets"]] == [("text", 1), ("image", 1)]


def test_guided_decode_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.engine guided --smoke: constrained and free runs at each batch
    size, every constrained row decoding the full length from graphs, and a compile time for
    each constraint of the suite."""
    from benchmarks.engine.guided_schemas import CASES

    out = tmp_path / "guided.json"
    _run_module("benchmarks.engine", "guided", "--smoke", "--out", str(out))
    rec = json.loads(out.read_text())
    assert [r["bs"] for r in rec["rows"]] == [1, 4]
    for r in rec["rows"]:
        for name in ("free", "constrained"):
            assert r[name]["replay_fraction"] == 1.0 and r[name]["step_ms"] > 0
            assert r[name]["min_output_tokens"] == 32
        assert r["constrained"]["finish_ms"] > 0 and r["free"]["finish_ms"] is None
    assert set(rec["compile_s"]) == {c.name for c in CASES}


def test_allreduce_smoke(tmp_path: Path) -> None:
    """python -m benchmarks.kernels allreduce --smoke: two gloo ranks run a step's collectives
    (checked sums first) and report one row per batch and family, with a step's count of
    collectives: the embedding's, two a text layer (cross layers too with an image), the
    vocabulary gather."""
    out = tmp_path / "allreduce.json"
    _run_module("benchmarks.kernels", "allreduce", "--tp", "2", "--smoke", "--batches", "1,4",
                "--replays", "2", "--json", str(out))
    rep = json.loads(out.read_text())
    assert rep["tp"] == 2
    got = [(r["bs"], r["family"], r["collectives"]) for r in rep["rows"]]
    assert got == [(1, "text", 10), (1, "image", 12), (4, "text", 10), (4, "image", 12)]
    assert all(r["step_us"] > 0 for r in rep["rows"])
