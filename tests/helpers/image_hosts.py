"""Image hosts on loopback for fetch tests: ``/img.png``; ``/slow`` (one byte every 20 ms, 200 in
all: a host trickling bytes); ``/to?u=URL`` (a 302 to URL)."""

from __future__ import annotations

import http.server
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def png(size: tuple[int, int] = (20, 20)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 60)).save(buf, format="PNG")
    return buf.getvalue()


PNG = png()


class _Host(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        if self.path == "/img.png":
            self._head(200, len(PNG))
            self.wfile.write(PNG)
        elif self.path == "/slow":
            self._head(200, 200)
            for _ in range(200):  # the attacker's pace; it stops as soon as the test ends
                if self.server.stopping.wait(0.02):  # type: ignore[attr-defined]
                    return
                self.wfile.write(b"x")
                self.wfile.flush()
        elif self.path.startswith("/to?u="):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/to?u="))
            self.send_header("Content-Length", "0")
            self.end_headers()

    def _head(self, status: int, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _serve() -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Host)
    httpd.stopping = threading.Event()  # type: ignore[attr-defined]
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@contextmanager
def image_hosts(count: int = 2) -> Iterator[tuple[int, ...]]:
    """``count`` image hosts on loopback, for the duration of the block: their ports."""
    servers = [_serve() for _ in range(count)]
    try:
        yield tuple(s.server_address[1] for s in servers)
    finally:
        for httpd in servers:
            httpd.stopping.set()  # type: ignore[attr-defined]
            httpd.shutdown()
            httpd.server_close()
