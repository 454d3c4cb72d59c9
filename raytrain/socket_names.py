"""Abstract Unix socket names as claims on a node: only one process in a network namespace can bind a name,
whoever runs it, and the kernel lets the name go when that process exits, however it ends (SIGKILL too).

raytrain claims a job's port block (``raytrain.launch.ports``) and a run's torch rendezvous port
(``raytrain.service.process_group``) with them, each with a name of its own that stands for the ports, which
are also probed (``port_free``) for whatever else binds them; ``ss -xlp`` shows who holds which name.
"""

from __future__ import annotations

import errno
import socket


def bind(name: str) -> socket.socket | None:
    """NAME bound: the socket that holds it, or None while another process holds it. OSError where this node
    cannot bind such names at all (a sandbox that forbids them)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0{name}")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def port_free(port: int) -> bool:
    """Whether a TCP socket can bind PORT on every address of this node now (nothing listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
