"""Which address and interface a node's Ray, NCCL and Gloo traffic should use."""

from __future__ import annotations

import ipaddress
import socket

import psutil

from raytrain.errors import UserError

_VIRTUAL = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "tun", "tap")


def _ipv4_by_iface() -> dict[str, list[str]]:
    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
        if name in up
    }


def iface_of(ip: str) -> str | None:
    for name, addrs in _ipv4_by_iface().items():
        if ip in addrs:
            return name
    return None


def ip_of(iface: str) -> str:
    addrs = _ipv4_by_iface().get(iface)
    if not addrs:
        known = ", ".join(sorted(n for n, a in _ipv4_by_iface().items() if a)) or "none"
        raise UserError(f"RAYTRAIN_IFNAME={iface} has no IPv4 address on {socket.gethostname()} (up: {known})")
    return addrs[0]


def route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest`` (a route lookup; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest, 9))
        except OSError as exc:
            raise UserError(f"{socket.gethostname()} has no route to the head at {dest} ({exc})") from None
        return str(s.getsockname()[0])


def _resolve(host: str) -> str | None:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        return None


def head_address(nodename: str, *, ifname: str | None, override: str | None) -> str:
    """The head's address: an explicit one, the interface's, or what its Slurm node name resolves to."""
    if override:
        return override
    if ifname:
        return ip_of(ifname)
    resolved = _resolve(nodename)
    if resolved and not ipaddress.ip_address(resolved).is_loopback and iface_of(resolved):
        return resolved
    for name, addrs in sorted(_ipv4_by_iface().items()):
        if addrs and not name.startswith(_VIRTUAL):
            return addrs[0]
    raise UserError(f"cannot find an address for the head on {nodename}: set RAYTRAIN_IFNAME or RAYTRAIN_HEAD_IP")


def node_address(head_ip: str, *, ifname: str | None) -> str:
    """A worker's address: the interface's if named, else the one that routes to the head."""
    return ip_of(ifname) if ifname else route_source(head_ip)
