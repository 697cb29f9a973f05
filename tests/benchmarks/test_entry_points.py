"""The benchmarks' entry points: every command of ``python -m benchmarks.{engine,profiling,
kernels}`` imports and parses its options on CPU, the vLLM-named scripts run from the
repository root, no script edits ``sys.path``, and the serving step trace records engine steps
(the GPU-only measurements themselves are not run here)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import dispatch

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("benchmarks.engine", "benchmarks.profiling", "benchmarks.kernels")


def _commands(entry: str) -> dict[str, tuple[str, str]]:
    return importlib.import_module(f"{entry}.__main__").COMMANDS


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_lists_every_command(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands(entry)
    dispatch(f"python -m {entry}", "doc", commands, ["--help"])
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in commands), out
    with pytest.raises(SystemExit, match="unknown command: nope"):
        dispatch(f"python -m {entry}", "doc", commands, ["nope"])


@pytest.mark.parametrize("entry, name", [(e, n) for e in ENTRY_POINTS for n in _commands(e)])
def test_every_command_parses_its_options(
    entry: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = f"python -m {entry} {name}"
    with pytest.raises(SystemExit) as done:
        dispatch(f"python -m {entry}", "doc", _commands(entry), [name, "--help"])
        raise SystemExit(0)  # a command whose help returns instead of exiting
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert prog in out, out[:500]


def test_entry_point_runs_as_a_module_from_the_root() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "decode-tune" in proc.stdout


@pytest.mark.parametrize("script", ["latency", "throughput", "serving"])
def test_vllm_named_scripts_run_from_the_root(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, f"benchmarks/benchmark_{script}.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--num-prompts" in proc.stdout or "--batch-size" in proc.stdout


def test_no_script_edits_sys_path() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "benchmarks").rglob("*.py")
        if "sys.path" in p.read_text()
    ]
    assert offenders == []


def test_serve_trace_records_engine_steps(tmp_path: Path) -> None:
    """The step hooks of ``python -m benchmarks.profiling serve`` on an offline tiny engine:
    one row per step, prompt tokens admitted by the prefill, none by decode steps; decode
    rows and chunks counted."""
    trace = tmp_path / "trace.json"
    code = (
        "from benchmarks.profiling import serve_trace as t\n"
        "t.install_step_trace()\n"
        "from vllm import LLM, SamplingParams\n"
        "llm = LLM(model='demo/mllama-tiny', max_model_len=256, max_num_seqs=2)\n"
        "llm.generate([{'prompt_token_ids': [1, 5, 6, 7]}],"
        " SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "t.dump()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STEP_TRACE": str(trace)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = json.loads(trace.read_text())["steps"]
    assert steps and all(len(row) == 17 and row[1] >= row[0] for row in steps)
    assert sum(row[10] for row in steps) == 4  # the one prompt's tokens, admitted once
    assert sum(row[16] for row in steps) == 1  # in one chunk
    assert sum(row[14] for row in steps) == 3  # the other three tokens decode, one row each
    assert sum(row[15] for row in steps) == 0  # no image


def test_serve_timeline_orders_a_chat_requests_stages(tmp_path: Path) -> None:
    """``python -m benchmarks.profiling timeline`` on the tiny model: two sequential chat
    requests (one streamed) each get their stages in order and the steps that ran them."""
    import signal

    import httpx
    from helpers.server_process import free_port, stop, wait_healthy

    timeline = tmp_path / "timeline.json"
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.profiling", "timeline", "demo/mllama-tiny",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
           "--uvicorn-log-level", "warning"]
    env = {**os.environ, "TIMELINE": str(timeline), "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": ""}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=120)
        for stream in (False, True):
            body = {"model": "demo/mllama-tiny", "max_tokens": 3, "stream": stream,
                    "messages": [{"role": "user", "content": "hello there"}]}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200
    finally:
        stop(proc, signal.SIGTERM)
    data = json.loads(timeline.read_text())
    assert data["overlapped"] == 0 and len(data["requests"]) == 2
    order = ["body_received", "handler", "prompt", "inputs", "engine_add", "scheduled"]
    for marks in data["requests"]:
        names = [m[0] for m in marks]
        assert [n for n in names if n in order] == order
        times = [m[1] for m in marks if m[0] in order]
        assert times == sorted(times) and times[0] >= 0
        steps = [m for m in marks if m[0] == "step"]
        assert steps and sum(m[3] for m in steps) >= 1  # the outputs came from these steps
        assert "first_body" in names
