"""Which hosts and ports an image URL may reach (see :mod:`vllm.multimodal.image`).

An address is *public* when it is globally routable and not multicast; an IPv6 address that
embeds an IPv4 one (IPv4-mapped ``::ffff:a.b.c.d``, IPv4-translated ``::ffff:0:a.b.c.d``,
IPv4-compatible ``::a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::``, Teredo)
is public only when the embedded address is, since a gateway turns it into that address; the
local-use NAT64 prefix ``64:ff9b:1::/48`` never is. Non-public addresses need an allow-list
entry: a host name, an address or a CIDR, each optionally with ``:port`` (``[v6]:port`` for an
IPv6 address) to allow only that port; ``*`` allows everything.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_BRACKETED = re.compile(r"^\[(?P<addr>[^\]]+)\](?::(?P<port>\d+))?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address stands for (none for a native IPv6 address)."""
    packed = ip.packed
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if packed[:8] == bytes(8) and packed[8:12] == b"\xff\xff\x00\x00":  # IPv4-translated
        return [ipaddress.IPv4Address(packed[12:])]
    if packed[:12] == bytes(12):  # IPv4-compatible (includes :: and ::1 -> 0.0.0.0/0.0.0.1)
        return [ipaddress.IPv4Address(packed[12:])]
    if ip in _NAT64:
        return [ipaddress.IPv4Address(packed[12:])]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    return []


def is_public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        inner = embedded_ipv4(ip)
        if inner:
            return all(is_public(v4) for v4 in inner)
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class AllowEntry:
    """One allow-list entry: a host name or a network, and a port (``None``: any port)."""

    host: str | IPNetwork
    port: int | None = None

    @classmethod
    def parse(cls, entry: str) -> AllowEntry:
        try:
            return cls(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            pass
        host, port = entry, None
        bracketed = _BRACKETED.match(entry)
        if bracketed:
            host, port = bracketed["addr"], bracketed["port"]
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"--allowed-image-hosts entry {entry!r} has an invalid port.")
        try:
            net: str | IPNetwork = ipaddress.ip_network(host, strict=False)
        except ValueError:
            net = host.lower()
        return cls(net, int(port) if port is not None else None)

    def matches(self, host: str, ip: IPAddress, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if isinstance(self.host, str):
            return self.host == host.lower()
        return ip.version == self.host.version and ip in self.host


class HostPolicy:
    """The allow-list and the checks made on every hop of a fetch."""

    def __init__(self, entries: Iterable[str]) -> None:
        cleaned = [e.strip() for e in entries if e.strip()]
        self.allow_all = "*" in cleaned
        self.entries = [AllowEntry.parse(e) for e in cleaned if e != "*"]

    def allows(self, host: str, ip: IPAddress, port: int) -> bool:
        if self.allow_all or is_public(ip):
            return True
        return any(e.matches(host, ip, port) for e in self.entries)

    @staticmethod
    def check_url(url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError):
            raise ValueError(f"Invalid image URL: {url!r}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"Invalid image URL: {url!r}")
        return parsed

    def pin(
        self, url: httpx.URL, infos: list[tuple[Any, ...]]
    ) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
        """The request aimed at the first resolved address, after checking that every one
        (and the port) is allowed; the Host header and the TLS server name stay the URL's."""
        addrs = [str(info[4][0]).split("%")[0] for info in infos]
        if not addrs:
            raise ValueError(f"Cannot resolve image host {url.host!r}.")
        port = url.port or _DEFAULT_PORTS[url.scheme]
        for addr in addrs:
            if not self.allows(url.host, ipaddress.ip_address(addr), port):
                raise ValueError(
                    f"Fetching images from {url.host!r} (port {port}) is not allowed: it "
                    "resolves to a private, loopback or otherwise non-public address."
                )
        return pinned_request(url, addrs[0])

    def next_url(self, url: httpx.URL, response: httpx.Response) -> httpx.URL | None:
        """The checked target of a redirect, ``None`` for a 200 (anything else: an error)."""
        if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
            try:
                return self.check_url(str(url.join(response.headers["location"])))
            except httpx.InvalidURL:
                raise ValueError(f"Invalid redirect from image URL {url}.") from None
        if response.status_code != 200:
            raise ValueError(f"Failed to fetch image from {url}: HTTP {response.status_code}.")
        return None


def pinned_request(url: httpx.URL, addr: str) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    """The request aimed at ``addr``, keeping Host and the TLS server name."""
    host = f"[{url.host}]" if ":" in url.host else url.host
    host_header = host if url.port is None else f"{host}:{url.port}"
    headers = {"Host": host_header, "Accept": "image/*"}
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    return url.copy_with(host=addr), headers, extensions
