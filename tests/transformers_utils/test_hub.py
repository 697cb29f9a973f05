"""Hub model IDs resolved through huggingface_hub: a cache laid out as huggingface_hub writes it
(offline), downloads from a loopback server standing in for the hub (``HF_ENDPOINT``), revisions,
``--download-dir``, a separate tokenizer, and the errors when a model is nowhere.

huggingface_hub reads its variables (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_HOME``,
``HF_HUB_CACHE``) when it is imported, so each scenario runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_hub import FakeHub, Revision, git_blob_id

from vllm.transformers_utils.demo_checkpoints import build_demo_config, get_demo_checkpoint
from vllm.transformers_utils.hub import ModelNotFoundError, looks_like_hub_id, resolve_model

REPO = "org/tiny-vision"
SCRIPT = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.hub import resolve_model
out = {}
for key, call in json.loads(sys.argv[1]).items():
    try:
        if call.pop("engine", False):
            mc = EngineArgs(**call).create_engine_config().model_config
            out[key] = {"path": str(mc.model_path), "tokenizer": str(mc.tokenizer_path),
                        "served": mc.served_model_name, "max_model_len": mc.max_model_len}
        elif call.pop("generate", False):
            from vllm import LLM, SamplingParams
            llm = LLM(**call)
            (res,) = llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True),
                                  use_tqdm=False)
            out[key] = {"tokens": len(res.outputs[0].token_ids)}
        else:
            out[key] = {"path": str(resolve_model(**call))}
    except Exception as e:
        out[key] = {"error": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(out))
"""


def _run(env: dict[str, str], calls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Runs ``calls`` (resolve_model, EngineArgs or LLM keyword sets) in a fresh interpreter."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(calls)],
        env={**base, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _tiny_files() -> dict[str, bytes]:
    folder = get_demo_checkpoint("demo/mllama-tiny")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def write_hub_cache(cache: Path, repo: str, files: dict[str, bytes], sha: str) -> Path:
    """The layout huggingface_hub writes: content-addressed ``blobs/``, ``snapshots/<commit>/``
    of relative symlinks into them, and ``refs/main`` holding the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / sha
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    for name, data in files.items():
        blob = root / "blobs" / git_blob_id(data)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_names_that_are_not_hub_ids(tmp_path: Path) -> None:
    assert looks_like_hub_id("meta-llama/Llama-3.2-11B-Vision-Instruct")
    for name in ("./ckpt", "/abs/ckpt", "~/ckpt", "a/b/c", "bad name/x", "ckpt/"):
        assert not looks_like_hub_id(name)
        with pytest.raises(ModelNotFoundError, match="no such folder"):
            resolve_model(name)
    with pytest.raises(ModelNotFoundError, match="unknown demo checkpoint"):
        resolve_model("demo/mllama-nope")  # the demo/ namespace never reaches the hub
    assert resolve_model(str(tmp_path)) == tmp_path


def test_offline_cache_as_huggingface_hub_lays_it_out(tmp_path: Path) -> None:
    """``HF_HUB_OFFLINE=1``: the snapshot of ``refs/main`` (or of a commit) is used, found
    through ``HF_HUB_CACHE``, ``HF_HOME`` or ``--download-dir``; a revision that is not cached
    is a ModelNotFoundError that says hub access is off."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "cache"
    snapshot = write_hub_cache(cache, REPO, _tiny_files(), sha)
    home_snapshot = write_hub_cache(tmp_path / "home" / "hub", REPO, _tiny_files(), sha)
    calls = {
        "main": {"name": REPO},
        "commit": {"name": REPO, "revision": sha},
        "tag": {"name": REPO, "revision": "v9"},
        "engine": {"engine": True, "model": REPO},
        "dir": {"name": REPO, "download_dir": str(cache)},
    }
    out = _run({"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}, calls)
    assert out["main"]["path"] == out["commit"]["path"] == str(snapshot)
    assert out["tag"]["error"] == "ModelNotFoundError"
    assert "HF_HUB_OFFLINE=1" in out["tag"]["message"] and "'v9'" in out["tag"]["message"]
    assert out["engine"]["served"] == REPO and out["engine"]["tokenizer"] == str(snapshot)
    home = _run({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}, calls)
    assert home["main"]["path"] == str(home_snapshot)
    assert home["dir"]["path"] == str(snapshot)  # --download-dir wins over HF_HOME


@pytest.fixture
def hub() -> Any:
    files = _tiny_files()
    files["original/consolidated.00.pth"] = b"\0" * 4096  # Meta's own format: never fetched
    v2 = build_demo_config("demo/mllama-tiny")
    v2["text_config"]["max_position_embeddings"] = 4096
    tok = {k: v for k, v in files.items() if k.startswith("tokenizer")}
    repos = {
        REPO: [
            Revision(files),
            Revision({**files, "config.json": json.dumps(v2).encode()}, names=("v2",)),
        ],
        "org/tokenizer-only": [Revision(tok)],
        "org/private": [Revision(tok)],
    }
    server = FakeHub(repos, private={"org/private": "secret-token"})
    yield server
    server.close()


def test_download_from_a_loopback_hub(hub: FakeHub, tmp_path: Path) -> None:
    """The real snapshot_download path: revision info, tree, HEAD + GET per file, LFS files
    redirected to another origin; ``--revision``, ``--download-dir``, ``--load-format dummy``,
    ``--tokenizer`` and the served name; then the same IDs offline from the cache."""
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "home")}
    dummy_dir = tmp_path / "dl"
    calls = {
        "main": {"name": REPO},
        "v2": {"engine": True, "model": REPO, "revision": "v2"},
        "dummy": {
            "engine": True,
            "model": REPO,
            "load_format": "dummy",
            "download_dir": str(dummy_dir),
        },
        "tok": {"engine": True, "model": REPO, "tokenizer": "org/tokenizer-only"},
        "no_repo": {"name": "org/missing"},
        "no_rev": {"name": REPO, "revision": "nope"},
        "gen": {"generate": True, "model": REPO, "max_model_len": 64, "max_num_seqs": 2},
        "private": {"name": "org/private", "weights": False},
        "token": {
            "engine": True,
            "model": REPO,
            "tokenizer": "org/private",
            "hf_token": "secret-token",
        },
    }
    out = _run(env, calls)
    main, v2 = hub.repos[REPO]
    snapshots = tmp_path / "home" / "hub" / "models--org--tiny-vision" / "snapshots"
    assert out["main"]["path"] == str(snapshots / main.sha)
    for name, data in main.files.items():
        if not name.startswith("original/"):
            assert (snapshots / main.sha / name).read_bytes() == data
    assert not any("original/" in p for p in hub.fetched())
    assert out["v2"] == {
        "path": str(snapshots / v2.sha),
        "tokenizer": str(snapshots / v2.sha),
        "served": REPO,
        "max_model_len": 4096,
    }
    dummy = Path(out["dummy"]["path"])
    assert dummy.is_relative_to(dummy_dir) and (dummy / "config.json").is_file()
    assert not list(dummy.glob("*.safetensors"))  # dummy weights: the shards stay on the hub
    assert "models--org--tokenizer-only" in out["tok"]["tokenizer"]
    assert out["no_repo"]["error"] == "ModelNotFoundError"
    assert "no such model" in out["no_repo"]["message"]
    assert "no such revision" in out["no_rev"]["message"]
    assert out["gen"] == {"tokens": 2}
    assert out["private"]["error"] == "ModelNotFoundError"
    assert "private: set HF_TOKEN" in out["private"]["message"]
    assert "models--org--private" in out["token"]["tokenizer"]  # --hf-token is sent
    served = len(hub.requests)
    offline = _run({**env, "HF_HUB_OFFLINE": "1"}, {"main": calls["main"], "v2": calls["v2"]})
    assert offline["main"] == out["main"] and offline["v2"] == out["v2"]
    assert len(hub.requests) == served  # offline: not one request
    (snapshots / main.sha / "model-00002-of-00002.safetensors").unlink()  # interrupted
    broken = _run({**env, "HF_HUB_OFFLINE": "1"}, {"main": calls["main"]})
    assert broken["main"]["error"] == "ModelNotFoundError"
    assert "is incomplete" in broken["main"]["message"]


def test_model_nowhere_is_one_line_error(tmp_path: Path) -> None:
    """Neither cached nor reachable: ``vllm serve ID`` prints one line and exits 1."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path),
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        "org/nowhere",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: model 'org/nowhere' is not a local folder")
    assert "the hub cannot be reached" in last and str(tmp_path / "hub") in last
