"""A failed GPU ends ``vllm serve``: one clear log line and a non-zero exit, so a supervisor
restarts it, instead of a process that answers /health with 503 for ever. The fault is injected
at the engine loop: the runner's launch raises what CUDA raises after an illegal memory access."""

from __future__ import annotations

import subprocess
import sys

import httpx
from test_reliability_faults import ENV, _free_port, _wait_healthy

SERVE_WITH_A_FAILING_GPU = """
import sys
from vllm.worker.model_runner import ModelRunner

launch = ModelRunner.launch

def failing_launch(self, out):
    if out.decode_seqs:  # the first decode step: the request's prefill went through
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return launch(self, out)

ModelRunner.launch = failing_launch
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", *sys.argv[1:]]
main()
"""


def test_a_failed_gpu_ends_the_server_with_a_nonzero_exit() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_A_FAILING_GPU, "demo/mllama-tiny", "--port",
         str(port), "--host", "127.0.0.1", "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        _wait_healthy(proc, url)
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 500 and "illegal memory access" in r.text
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read() if proc.stdout else ""
    assert rc == 1, log
    failures = [line for line in log.splitlines() if "Engine failed" in line]
    assert len(failures) == 1 and "DeviceError" in failures[0], log
    assert "the server exits with status 1" in failures[0]
    assert "Traceback" not in log, log
