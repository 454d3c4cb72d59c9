"""Listing a Slurm job's listening sockets on the testbed's nodes and probing them without a token."""

from __future__ import annotations

import importlib
import pkgutil
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

LOOPBACK = re.compile(r"^(127\.|\[::ffff:127\.|\[::1\])")


@dataclass(frozen=True)
class Listener:
    node: str
    address: str
    port: int
    pid: int
    process: str

    @property
    def loopback(self) -> bool:
        return bool(LOOPBACK.match(self.address))


def _job_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"SLURM_JOB_ID="):
            return item.split(b"=", 1)[1].decode()
    return None


def _listening(node: int, *ss_filter: str) -> str:
    """``ss -ltnp`` inside a testbed node's network namespace."""
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/rtn{node}", "ss", "-ltnpH", *ss_filter],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def still_listening(lst: Listener) -> bool:
    """Whether the process still listens on the port (Ray ends idle workers at any time)."""
    return f"pid={lst.pid}," in _listening(int(lst.node.removeprefix("node")), f"sport = :{lst.port}")


def job_listeners(job_id: str, nodes: int = 3) -> list[Listener]:
    found = []
    for i in range(1, nodes + 1):
        out = _listening(i)
        for line in out.splitlines():
            fields = line.split()
            local, users = fields[3], " ".join(fields[5:])
            for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', users):
                if _job_of(int(pid)) == job_id:
                    address, port = local.rsplit(":", 1)
                    found.append(Listener(f"node{i}", address, int(port), int(pid), name))
                    break
    return found


def ray_worker_ports(node_root: Path, job_id: str) -> set[int]:
    """The gRPC ports of Ray's worker processes on a node, from their logs in the job's temp dir there."""
    ports = set()
    for log in node_root.glob(f"tmp/rt{job_id}.*/ray/session_*/logs/python-core-worker-*.log"):
        with log.open(errors="replace") as f:
            for line in f:
                if m := re.search(r"Initializing worker at address: [\d.]+:(\d+)", line):
                    ports.add(int(m.group(1)))
                    break
    return ports


def http_status(
    host: str, port: int, path: str = "/", headers: dict[str, str] | None = None, method: str = "GET"
) -> int | None:
    """Status of a plain HTTP/1.1 request, or None if the port does not speak HTTP/1.1."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    body = "{}" if method == "POST" else ""
    if body:
        extra += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n{body}".encode())
            head = s.recv(64)
    except OSError:
        return None
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return int(m.group(1)) if m else None


def _ray_methods() -> list[str]:
    """Every unary gRPC method of Ray's services, read-only ones (Get/List/Check...) first."""
    import ray.core.generated as gen

    methods = []
    for mod in pkgutil.iter_modules(gen.__path__):
        if not mod.name.endswith("_pb2"):
            continue
        desc = importlib.import_module(f"ray.core.generated.{mod.name}").DESCRIPTOR
        for service in desc.services_by_name.values():
            for m in service.methods:
                if not (m.client_streaming or m.server_streaming):
                    methods.append(f"/{service.full_name}/{m.name}")
    # Raylet's object manager has no Python stubs; its transfer calls need the token like the rest.
    methods += ["/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.ObjectManagerService/Push"]
    read_only = re.compile(r"/(Get|List|Check|Report|Health|Is|Pull)[A-Z]?")
    return sorted(methods, key=lambda m: (not read_only.search(m), m))


def grpc_call(channel: grpc.Channel, method: str, token: str | None, timeout: float = 2) -> str:
    """Status code name of one unary call with an empty request, with the token (if any) as Ray sends it."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        call(b"", timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"


def grpc_probe(host: str, port: int, token: str | None = None) -> dict[str, str]:
    """Call Ray's gRPC methods on a port with an empty request; code of each that the server implements."""
    codes: dict[str, str] = {}
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        for method in _ray_methods():
            code = grpc_call(channel, method, token)
            if code != "UNIMPLEMENTED":
                codes[method] = code
                if code in ("UNAUTHENTICATED", "UNAVAILABLE"):
                    break  # the server checks the token (or is gone): one call says it
    return codes
