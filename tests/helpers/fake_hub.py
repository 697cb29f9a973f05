"""A loopback HTTP server that answers the Hugging Face hub endpoints ``snapshot_download`` uses,
so the real download code path runs against it (``HF_ENDPOINT=<server url>``).

Endpoints, as the hub serves them:

* ``GET /api/models/{repo}/revision/{rev}``: the repository's info with the commit ``sha``;
  404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` otherwise.
* ``GET /api/models/{repo}/tree/{rev}``: the file listing (``oid`` is the git blob id; large
  files carry an ``lfs`` entry with their sha256).
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: small files are answered directly, with ``ETag``
  (the blob id), ``X-Repo-Commit`` and ``Content-Length``; large (LFS) files redirect to
  ``/lfs/{sha256}`` (an absolute URL, as the hub redirects to its CDN) with ``X-Linked-Etag``
  and ``X-Linked-Size``.

Every request is recorded in ``requests`` (method, path) so tests can check what was fetched.
A repository in ``private`` answers only requests carrying its token (``Authorization: Bearer``)
and 401 ``RepoNotFound`` otherwise, as the hub does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".pth", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Revision:
    """One commit of a repository: its files, and the branch or tag names pointing at it."""

    files: dict[str, bytes]
    names: tuple[str, ...] = ("main",)
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        listing = "".join(f"{p}:{git_blob_id(d)}\n" for p, d in sorted(self.files.items()))
        self.sha = hashlib.sha1(listing.encode()).hexdigest()


class FakeHub:
    """Serves ``repos`` (repo id -> its revisions) on 127.0.0.1 until ``close()``."""

    def __init__(
        self, repos: dict[str, list[Revision]], private: dict[str, str] | None = None
    ) -> None:
        self.repos = repos
        self.private = private or {}
        self.requests: list[tuple[str, str]] = []
        self.blobs = {
            hashlib.sha256(data).hexdigest(): data
            for revs in repos.values()
            for rev in revs
            for data in rev.files.values()
        }
        self._servers = [
            ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class()) for _ in range(2)
        ]  # the hub, and its CDN
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in self._servers
        ]
        for t in self._threads:
            t.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def close(self) -> None:
        for server, thread in zip(self._servers, self._threads, strict=True):
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)

    def find(self, repo: str, rev: str) -> Revision | None:
        for r in self.repos.get(repo, []):
            if rev == r.sha or rev in r.names:
                return r
        return None

    def fetched(self, method: str = "GET") -> list[str]:
        return [p for m, p in self.requests if m == method]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

        return Handler

    # ------------------------------------------------------------------ routing
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            return self._api(h, "/".join(parts[2:4]), parts[4], parts[5])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        if len(parts) == 2 and parts[0] == "lfs" and parts[1] in self.blobs:
            data = self.blobs[parts[1]]
            return self._send(h, 200, data if body else b"", {"Content-Length": str(len(data))})
        return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound"})

    def _missing(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> Revision | None:
        token = self.private.get(repo)
        if token is not None and h.headers.get("Authorization") != f"Bearer {token}":
            msg = json.dumps({"error": "Invalid username or password."}).encode()
            self._send(h, 401, msg, {"X-Error-Code": "RepoNotFound"})
            return None
        found = self.find(repo, rev)
        if found is None:
            code = "RevisionNotFound" if repo in self.repos else "RepoNotFound"
            msg = json.dumps({"error": f"{code}: {repo}@{rev}"}).encode()
            self._send(h, 404, msg, {"X-Error-Code": code, "X-Error-Message": code})
        return found

    def _api(self, h: BaseHTTPRequestHandler, repo: str, kind: str, rev: str) -> None:
        found = self._missing(h, repo, rev)
        if found is None:
            return
        if kind == "revision":
            siblings = [{"rfilename": p} for p in sorted(found.files)]
            info = {"id": repo, "modelId": repo, "sha": found.sha, "siblings": siblings}
            return self._json(h, info)
        entries = []
        for p, data in sorted(found.files.items()):
            entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_id(data)}
            if p.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return self._json(h, entries)

    def _resolve(
        self, h: BaseHTTPRequestHandler, repo: str, rev: str, file: str, body: bool
    ) -> None:
        found = self._missing(h, repo, rev)
        if found is None:
            return
        if file not in found.files:
            return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound"})
        data = found.files[file]
        headers = {"X-Repo-Commit": found.sha}
        if file.endswith(LFS_SUFFIXES):
            sha = hashlib.sha256(data).hexdigest()
            headers.update(
                {
                    "Location": f"{self.cdn_url}/lfs/{sha}",
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{git_blob_id(data)}"',
                    "Content-Length": "0",
                }
            )
            return self._send(h, 302, b"", headers)
        headers.update({"ETag": f'"{git_blob_id(data)}"', "Content-Length": str(len(data))})
        return self._send(h, 200, data if body else b"", headers)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, value: object) -> None:
        data = json.dumps(value).encode()
        FakeHub._send(h, 200, data, {"Content-Type": "application/json"})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        headers = {"Content-Length": str(len(data)), **headers}
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if data and h.command != "HEAD":
            h.wfile.write(data)
