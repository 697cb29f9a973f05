"""Nagle's algorithm is off on the server's connections: otherwise each small write of a
stream waits for the client's (delayed) acknowledgement of the one before."""

from __future__ import annotations

import socket

from vllm.entrypoints.openai.api_server import create_server_socket
from vllm.entrypoints.openai.http_limits import set_nodelay


class _Transport:
    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def _accepted(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    listener.listen(1)
    client = socket.create_connection(listener.getsockname()[:2])
    conn, _ = listener.accept()
    return client, conn


def test_set_nodelay_on_a_socket_of_protocol_zero() -> None:
    # A listening socket made with the default protocol number: asyncio leaves its
    # connections with Nagle on.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    client, conn = _accepted(listener)
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        set_nodelay(_Transport(conn))
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        for s in (client, conn, listener):
            s.close()


def test_set_nodelay_ignores_closed_and_missing_sockets() -> None:
    set_nodelay(_Transport(None))
    a, b = socket.socketpair()  # AF_UNIX: no TCP option to set
    set_nodelay(_Transport(a))
    a.close(), b.close()


def test_listening_socket_is_tcp_by_protocol_number() -> None:
    sock = create_server_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
