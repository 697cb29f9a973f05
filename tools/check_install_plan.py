"""Resolves what tools/setup_cpu.sh installs, as a machine whose pip sees only the public index.

The plan is the torch pin from tools/setup_cpu.sh (its default build, what such a machine gets)
with constraints.txt, requirements-cpu.txt and requirements-test.txt, resolved together by
``pip install --dry-run --ignore-installed`` with pip's local configuration ignored: no config
file and no PIP_* variable (so no local wheel folder, extra index or constraints), only the
trust store. A plan that does not resolve fails (exit 1, pip's error printed); an index that
cannot be reached skips (exit 0, the reason printed).

Nothing is installed and no whole wheel is downloaded (torch's default build and the CUDA
libraries it pulls in are several GB): pip 25.3 and later stop a dry run before downloading,
and read each wheel's metadata from the index's metadata files or, where the index has none,
from the wheel's zip directory by HTTP range requests (``--use-feature=fast-deps``; tens of MB
in all). An older pip runs a newer one from a pip wheel.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tools" / "setup_cpu.sh"
# The two pip installs of tools/setup_cpu.sh, resolved as one.
REQUIREMENTS = [
    "-c",
    "constraints.txt",
    "-r",
    "requirements-cpu.txt",
    "-r",
    "requirements-test.txt",
]
NEW_PIP = "pip>=25.3,<27"  # dry runs that download no whole wheel; fast-deps still there
KEEP = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY"}  # how to reach an index, not what it holds
RESOLVE_TIMEOUT_S = 300
SHOWN = ("torch", "triton", "transformers")


def say(msg: str) -> None:
    print(f"check_install_plan: {msg}", flush=True)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEEP}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def torch_pin() -> str:
    found = re.findall(r"^TORCH_PIN=(\S+)$", SETUP.read_text(), re.M)
    if len(found) != 1:
        raise SystemExit(f"check_install_plan: expected one TORCH_PIN= line in {SETUP}")
    return found[0]


def index_unreachable(env: dict[str, str]) -> str | None:
    """Why pip's default index cannot be reached, or None when it answers."""
    from pip._internal.models.index import PyPI

    url = PyPI.simple_url.rstrip("/") + "/pip/"
    context = ssl.create_default_context(cafile=env.get("PIP_CERT") or None)
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            response.read(1)
    except OSError as e:  # URLError, HTTPError, timeouts
        return f"{url}: {e}"
    return None


def pip_version() -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("pip"))[:2])


def pip_command(env: dict[str, str], tmp: Path) -> list[str]:
    """A pip whose dry run downloads no wheel: this interpreter's, or one run from its wheel."""
    if pip_version() >= (25, 3):
        return [sys.executable, "-m", "pip"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
    subprocess.run([*cmd, "--dest", str(tmp), NEW_PIP], env=env, check=True, timeout=120)
    (wheel,) = tmp.glob("pip-*.whl")
    return [sys.executable, str(wheel / "pip")]


def main() -> int:
    env = clean_env()
    reason = index_unreachable(env)
    if reason:
        say(f"skipped: the package index cannot be reached ({reason})")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        report = tmp / "report.json"
        plan = [torch_pin(), *REQUIREMENTS]
        cmd = [*pip_command(env, tmp), "install", "--dry-run", "--ignore-installed"]
        cmd += ["--use-feature=fast-deps", "--timeout", "30", "--report", str(report), *plan]
        say("resolving " + " ".join(plan) + " with pip's local configuration ignored")
        try:
            done = subprocess.run(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=RESOLVE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            say(f"FAILED: no resolution in {RESOLVE_TIMEOUT_S} s (downloading whole wheels?)")
            return 1
        if done.returncode != 0:
            lines = done.stdout.splitlines()  # pip's messages, from its first error on
            errors = [i for i, line in enumerate(lines) if line.startswith("ERROR:")]
            print("\n".join(lines[errors[0] if errors else 0 :]), flush=True)
            say(f"FAILED: the install plan does not resolve (pip exit {done.returncode})")
            return 1
        installs = json.loads(report.read_text())["install"]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    shown = ", ".join(f"{n} {versions[n]}" for n in SHOWN if n in versions)
    took = time.monotonic() - start
    say(f"ok: {len(versions)} packages resolve ({shown}) in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
