"""Two real network hosts on one machine: Linux network namespaces joined by a veth pair. Each
has its own loopback, so a rank that advertised 127.0.0.1 (what the hostname resolves to) could
not be reached from the other: only this catches that. Needs root and iproute2 (skips otherwise)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str, str]]:
    """(namespace A, namespace B, the /24 prefix): A holds PREFIX.1, B PREFIX.2."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = os.getpid() % 100000
    a, b, net = f"pgA{tag}", f"pgB{tag}", f"10.231.{tag % 250}"
    try:
        ip("netns", "add", a)
    except subprocess.CalledProcessError:
        pytest.skip("cannot create network namespaces here")
    try:
        ip("netns", "add", b)
        ip("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
        for ns, host in ((a, 1), (b, 2)):
            ip("link", "set", f"{ns}v", "netns", ns)
            ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", f"{ns}v")
            ip("-n", ns, "link", "set", f"{ns}v", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, net
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
