"""The README's two commands, run as written (the serve command on a free port)."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[0].strip(), blocks[1].strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ci_runs_the_readme_test_command() -> None:
    _, test_cmd = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()


def test_readme_serve_command_serves_an_image_chat() -> None:
    serve_cmd, _ = readme_commands()
    port = _free_port()
    proc = subprocess.Popen(f"{serve_cmd} --port {port}", shell=True, cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the README's server did not come up")
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (255, 0, 0)).save(buf, format="PNG")
        image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        body = {"model": "demo/mllama-tiny", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "What is in this image?"}]}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_readme_says_how_to_bind_loopback_and_where_the_demo_tokenizer_is() -> None:
    """The README's loopback flag, and its command that prints the demo folder: the folder
    it prints holds a tokenizer that transformers loads (what client tools are given)."""
    from transformers import AutoTokenizer

    text = (ROOT / "README.md").read_text()
    assert "`--host 127.0.0.1` keeps it to this machine" in text
    command = ".venv/bin/python -m vllm.transformers_utils.demo_checkpoints demo/mllama-tiny"
    assert command in text
    args = command.split()[1:]
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.name == "mllama-tiny-v2" and (folder / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.convert_tokens_to_ids("<|image|>") == 512
