"""An upstream-style launch script, end to end: ``vllm serve --config FILE.yaml`` plus flags in
every spelling, over TLS with client certificates, several API keys, the processor's own
options and the accepted-with-a-warning settings; the start-up log's messages."""

from __future__ import annotations

import os
import queue
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_server_utils import image_message, png_data_url

from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.cli_args import ssl_options, validate_parsed_serve_args

START_TIMEOUT_S = 120


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=test-ca", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=folder)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                 cwd=folder)  # fmt: skip
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                    "client.key")}  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_ssl_flags_are_checked(certs: dict[str, Path], tmp_path: Path) -> None:
    base = ["serve", "demo/mllama-tiny", "--ssl-certfile", str(certs["server.pem"]),
            "--ssl-keyfile", str(certs["server.key"])]  # fmt: skip
    args = make_parser().parse_args(
        [*base, "--ssl-ca-certs", str(certs["ca.pem"]), "--ssl-cert-reqs", "2"]
    )
    validate_parsed_serve_args(args)
    assert ssl_options(args)["ssl_ca_certs"] == str(certs["ca.pem"])
    assert ssl_options(args)["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    for extra, message in (
        (["--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--ssl-ca-certs", str(tmp_path / "none.pem")], "is not a readable file"),
    ):
        bad = make_parser().parse_args([*base, *extra])
        with pytest.raises(ValueError, match=message):
            validate_parsed_serve_args(bad)
    plain = make_parser().parse_args(["serve", "m", "--ssl-cert-reqs", "1"])
    with pytest.raises(ValueError, match="need --ssl-certfile"):
        validate_parsed_serve_args(plain)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vllm serve`` in a subprocess; its output lines are collected by a reader thread."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float) -> None:
        """Collects output until a line contains ``text`` (the process ending fails)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {text!r} in time:\n" + "".join(self.lines[-40:])
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            assert line is not None, "the server exited:\n" + "".join(self.lines[-40:])
            self.lines.append(line)
            if text in line:
                return

    def wait_listening(self, port: int, timeout: float) -> None:
        """Until ``port`` accepts a connection: uvicorn starts listening on the socket
        ``vllm serve`` bound once its start-up is complete. Between refused attempts, waits
        for output for a moment (and keeps it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                return
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "".join(self.lines[-40:])
                assert self.proc.poll() is None, "".join(self.lines[-40:])
            try:
                line = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is not None:
                self.lines.append(line)

    def stop(self) -> tuple[int, str]:
        """SIGINT, then the exit status and the whole output."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        while (line := self._queue.get(timeout=30)) is not None:  # the reader ends at EOF
            self.lines.append(line)
        return code, "".join(self.lines)


def _client(certs: dict[str, Path], with_cert: bool) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    if with_cert:
        context.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
    return httpx.Client(verify=context, timeout=60)


def _launch(certs: dict[str, Path], tmp_path: Path, port: int) -> ServerProcess:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: demo/mllama-tiny\n"
        "host: 127.0.0.1\n"
        f"port: {port}\n"
        "max-num-seqs: 4\n"
        "api-key: [key-a, key-b]\n"
        f"ssl-certfile: {certs['server.pem']}\n"
        f"ssl-keyfile: {certs['server.key']}\n"
        f"ssl-ca-certs: {certs['ca.pem']}\n"
        "ssl-cert-reqs: 2\n"
        "disable-frontend-multiprocessing: true\n"
        "swap-space: 8\n"
        "uvicorn-log-level: info\n"
    )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--config", str(config),
        "-pp", "1", "--max_model_len", "1k", "--no-trust-remote-code",
        "--limit-mm-per-prompt.image", "2", "--limit-mm-per-prompt.video", "0",
        "--mm-processor-kwargs.max_image_tiles", "2", "--tokenizer-mode", "slow",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "VLLM_API_KEY": ""}
    env["PYTHONUNBUFFERED"] = "1"
    return ServerProcess(cmd, env)


def _chat(client: httpx.Client, url: str, key: str) -> dict[str, Any]:
    messages = image_message(png_data_url((200, 50)), "Two images")
    messages[0]["content"].insert(0, dict(messages[0]["content"][0]))
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    r = client.post(f"{url}/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    tok = client.post(f"{url}/tokenize", json={"messages": messages},
                      headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    return {"usage": r.json()["usage"], "count": tok.json()["count"]}


def test_upstream_launch_script_end_to_end(certs: dict[str, Path], tmp_path: Path) -> None:
    port = _free_port()
    server = _launch(certs, tmp_path, port)
    url = f"https://127.0.0.1:{port}"
    try:
        server.wait_for("Application startup complete", START_TIMEOUT_S)
        server.wait_listening(port, timeout=30)  # uvicorn listens right after that line
        with _client(certs, with_cert=True) as client:
            r = client.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-b"})
            assert r.status_code == 200, r.text
            assert r.json()["data"][0]["max_model_len"] == 1000  # --max_model_len 1k
            assert client.get(f"{url}/v1/models").status_code == 401
            chat = _chat(client, url, "key-a")
        # Two images (--limit-mm-per-prompt.image 2), each tiled 2 wide
        # (--mm-processor-kwargs.max_image_tiles 2): 2 x 2 x 17 vision tokens.
        assert chat["usage"]["prompt_tokens"] == chat["count"] + 2 * 2 * 17
        with _client(certs, with_cert=False) as anonymous, pytest.raises(httpx.TransportError):
            anonymous.get(f"{url}/health")  # --ssl-cert-reqs 2: no certificate, no TLS
    finally:
        code, log = server.stop()
    assert code == 0, log[-3000:]
    for expected in (
        "Model demo/mllama-tiny: float32 weights and activations on cpu",
        "--gpu-memory-utilization (0.9) does not apply",
        "Ignoring swap_space=8.0: there is no CPU swap space",
        "Ignoring tokenizer_mode='slow'",
        "VLLM_ATTENTION_BACKEND=FLASH_ATTN names an upstream vLLM back-end",
        "already run in one process",
    ):
        assert expected in log, expected
