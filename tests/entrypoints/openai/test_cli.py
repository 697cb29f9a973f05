"""The command line: ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server`` in
subprocesses (help, bad flags, unsupported values, a busy port, a real start), and the flag
parser in-process."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.server_process import free_port, stop, wait_healthy

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.api_server import run_server
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": ""}


def _run(cmd: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_help_and_bad_flag_exit_codes() -> None:
    r = _run([*VLLM, "serve", "--help"])
    assert r.returncode == 0
    for flag in (
        "--max-model-len",
        "--limit-mm-per-prompt",
        "--served-model-name",
        "--api-key",
        "--chat-template",
        "--enable-log-requests",
        "--cuda-graph-sizes",
    ):
        assert flag in r.stdout
    r = _run([*API_SERVER, "--model", "demo/mllama-tiny", "--no-such-flag"])
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


def _serve_args(*extra: str, model: str = "demo/mllama-tiny") -> argparse.Namespace:
    return make_parser().parse_args(["serve", model, *extra])


def test_bad_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _serve_args("--dtype", "int3")
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_unsupported_quantization_is_a_clean_error() -> None:
    """EngineArgs' ValueError becomes SystemExit(message): printed, no traceback, exit 1."""
    with pytest.raises(SystemExit) as exc:
        run_server(_serve_args("--host", "127.0.0.1", "--port", "0", "--quantization", "awq"))
    assert isinstance(exc.value.code, str)
    assert "quantization='awq' is not supported;" in exc.value.code


def test_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            run_server(_serve_args("--host", "127.0.0.1", "--port", str(port)))
    assert isinstance(exc.value.code, str) and "already in use" in exc.value.code


def test_vllm_serve_starts_and_stops() -> None:
    port = free_port()
    cmd = [
        *VLLM,
        "serve",
        "demo/mllama-tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max_model_len",
        "256",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "tiny",
        "alias",
        "--uvicorn-log-level",
        "warning",
        "--limit-mm-per-prompt",
        "image=2",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny", "alias"]
        assert models["data"][0]["max_model_len"] == 256
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={
                "model": "alias",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200 and r.json()["model"] == "alias"
    finally:
        code = stop(proc, timeout=30)
    assert code == 0


def test_every_engine_field_has_a_flag() -> None:
    parser = make_arg_parser(FlexibleArgumentParser(), positional_model=True)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= dests


def test_flag_spellings_and_values() -> None:
    parser = make_parser()
    args = parser.parse_args(
        [
            "serve",
            "demo/mllama-tiny",
            "--max_model_len",
            "512",
            "--max-num-seqs=8",
            "--cuda-graph-sizes",
            "1,2",
            "4",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--enforce_eager",
            "--served-model-name",
            "a",
            "b",
            "--load-format",
            "dummy",
            "--trust-remote-code",
            "--disable-log-requests",
            "--allowed-origins",
            '["http://x"]',
        ]
    )
    validate_parsed_serve_args(args)
    assert args.model == "demo/mllama-tiny" and args.port == 8000
    ea = EngineArgs.from_cli_args(args)
    assert ea.max_model_len == 512 and ea.max_num_seqs == 8 and ea.enforce_eager
    assert ea.cuda_graph_sizes == [1, 2, 4] and ea.limit_mm_per_prompt == {"image": 2}
    assert ea.served_model_name == ["a", "b"] and ea.load_format == "dummy"
    assert ea.seed == EngineArgs.seed  # unset flags keep EngineArgs' defaults
    assert args.allowed_origins == ["http://x"]
    legacy = make_parser().parse_args(["serve", "--model", "m", "--limit-mm-per-prompt", "image=3"])
    validate_parsed_serve_args(legacy)
    assert legacy.model == "m" and legacy.limit_mm_per_prompt == {"image": 3}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--limit-mm-per-prompt", "video=1"])


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    args = make_parser().parse_args(["serve", "m"])
    validate_parsed_serve_args(args)
    assert args.api_key == ["from-env"]


def test_demo_11b_without_llama_models_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The full-size demos need the optional llama-models package for their tokenizer: without
    it ``vllm serve demo/mllama-11b`` prints how to install it, with no traceback."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_models" else real_find_spec(name, *a),
    )
    monkeypatch.setenv("VLLM_DEMO_DIR", str(tmp_path))  # nothing cached: the build runs
    with pytest.raises(SystemExit) as exc:
        run_server(_serve_args("--host", "127.0.0.1", "--port", "0", model="demo/mllama-11b"))
    message = exc.value.code
    assert isinstance(message, str) and message.startswith("Error: ")
    assert "\n" not in message and "pip install llama-models" in message


def test_server_freezes_start_up_objects_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything alive once the engine is built is out of the garbage collector's reach
    before the first request is served: a full collection while serving (a pause of every
    stream) scans only the objects requests created since."""
    from vllm.entrypoints.openai import api_server

    seen = {}

    def serve(server, sock) -> None:  # instead of running uvicorn
        seen["frozen"] = gc.get_freeze_count()
        seen["tracked"] = len(gc.get_objects())

    monkeypatch.setattr(api_server, "_serve", serve)
    gc.unfreeze()
    try:
        run_server(_serve_args("--host", "127.0.0.1", "--port", "0", "--max-model-len", "256"))
    finally:
        gc.unfreeze()  # give the rest of the test session its collector back
    # The imported libraries and the engine alone are over 100,000 objects.
    assert seen["frozen"] > 100_000
    assert seen["tracked"] < seen["frozen"] // 10
