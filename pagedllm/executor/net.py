"""Addresses for ranks on several hosts (multi-node and Ray): which IP this node uses, and making
gloo bind and advertise it rather than what the hostname resolves to (often 127.0.x.1, which
other hosts cannot reach)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from pagedllm import envs
from pagedllm.config.parallel import ParallelConfig, parse_init_method

# TCP keepalive on the control connections: idle seconds, probe interval, probes. A peer whose
# machine vanished (no FIN) is noticed in about 25 s, even while the engine is idle.
_KEEPALIVE = (10, 5, 3)


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def resolve(host: str) -> str:
    """``host``'s IPv4 address; a ValueError naming the host when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve {host!r} (the --distributed-init-method host): {e}") from None


def node_ip(parallel: ParallelConfig) -> str:
    """The address this node's ranks use and advertise in a multi-node run. Node 0 listens at the
    init method's host, so that is its address and must be one of its own; another node uses
    ``PAGEDLLM_HOST_IP``, else its source address on the route to node 0. Loopback only when node 0's
    address is loopback itself (every node on one machine)."""
    assert parallel.distributed_init_method is not None
    host, _ = parse_init_method(parallel.distributed_init_method)
    head = resolve(host)
    ip = head if parallel.node_rank == 0 else (envs.host_ip() or route_source(head))
    if parallel.node_rank == 0 and envs.host_ip() not in (None, head):
        raise ValueError(
            f"PAGEDLLM_HOST_IP={envs.host_ip()} on node 0 differs from the --distributed-init-method host {head}: "
            "node 0 listens at the init method's host, so give its own address there"
        )
    if is_loopback(ip) and not is_loopback(head):
        raise ValueError(
            f"node {parallel.node_rank} would advertise the loopback address {ip}, which node 0 ({head}) cannot "
            "reach: set PAGEDLLM_HOST_IP to this node's routable address"
        )
    _check_local(ip, parallel.node_rank)
    return ip


def route_source(dest: str) -> str:
    """The local address the kernel would send from to reach ``dest`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))
        return str(s.getsockname()[0])


def _check_local(ip: str, node_rank: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            where = "the --distributed-init-method host" if node_rank == 0 else "PAGEDLLM_HOST_IP"
            raise ValueError(
                f"{ip} ({where}) is not an address of node {node_rank}: "
                + ("node 0 listens there, so give one of its own IPs" if node_rank == 0 else "give one of its own IPs")
            ) from None


def pin_gloo_interface(node_ip: str) -> None:
    """Bind gloo to the interface holding ``node_ip``, unless the user chose one (GLOO_SOCKET_IFNAME).
    An address no interface holds (127.0.0.2, ...: routed to lo) leaves gloo's default."""
    if envs.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(node_ip)
    if name is not None:
        envs.set_gloo_socket_ifname(name)


def interface_of(ip: str) -> str | None:
    """The network interface whose IPv4 address is ``ip`` (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's address, a sockaddr_in at bytes 16..32
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def set_keepalive(sock: socket.socket) -> None:
    """Probe an idle connection, so a peer machine that vanished without closing it is noticed."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = _KEEPALIVE
    for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, opt):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
