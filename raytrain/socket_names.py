"""Abstract Unix socket names as claims on a node: only one process in a network namespace can bind a name,
whoever runs it, and the kernel lets the name go when that process exits, however it ends (SIGKILL too).

raytrain claims a job's port block (``raytrain.launch.ports``) and a run's torch rendezvous port
(``raytrain.service.process_group``) with them; ``ss -xlp`` shows who holds which.
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
