"""What a user on their own machine needs to open a job's dashboard on the Slurm testbed: an ssh server on
the login node (the root namespace, under the submit host's name) and on the head node (inside node1's
namespace), and the ssh tunnel command raytrain prints, run as printed. The test's ssh client settings
(its key, the login node's port) come from an ssh config file, as a user's ``~/.ssh/config`` would."""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from raytrain import waits

SSHD = "/usr/sbin/sshd"
LOGIN_PORT = 2222  # the root namespace's sshd: never the machine's own port 22


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def _sshd(where: list[str], listen: str, port: int, keys: Path, name: str) -> subprocess.Popen[bytes]:
    config = keys / f"sshd-{name}.conf"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {listen}:{port}",
                f"HostKey {keys / 'host_ed25519'}",
                f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                f"PidFile {keys / f'sshd-{name}.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowTcpForwarding yes",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    log = (keys / f"sshd-{name}.log").open("wb")
    return subprocess.Popen([*where, SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)


def _listens(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def wait_port(host: str, port: int, timeout: float) -> None:
    if not waits.until(lambda: _listens(host, port), timeout_s=timeout, every_s=0.2):
        raise AssertionError(f"nothing listens on {host}:{port} after {timeout} s")


@contextlib.contextmanager
def ssh_servers(keys: Path, head_netns: str, head_ip: str, login: str) -> Iterator[Path]:
    """sshd on the login node (reached as ``login``) and on the head; yields the client's ssh config file."""
    keys.mkdir(parents=True, exist_ok=True)
    _keygen(keys / "host_ed25519")
    _keygen(keys / "id_ed25519")
    (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
    config = keys / "ssh_config"
    config.write_text(
        "\n".join(
            [
                f"Host {login}",
                "  HostName 127.0.0.1",
                f"  Port {LOGIN_PORT}",
                "Host *",
                f"  IdentityFile {keys / 'id_ed25519'}",
                "  IdentitiesOnly yes",
                "  UserKnownHostsFile /dev/null",
                "  StrictHostKeyChecking no",
                "  LogLevel ERROR",
                "  ExitOnForwardFailure yes",
                "",
            ]
        )
    )
    servers = [
        _sshd([], "127.0.0.1", LOGIN_PORT, keys, "login"),
        _sshd(["nsenter", f"--net=/run/netns/{head_netns}"], head_ip, 22, keys, "head"),
    ]
    try:
        wait_port("127.0.0.1", LOGIN_PORT, timeout=20)
        wait_port(head_ip, 22, timeout=20)
        yield config
    finally:
        for server in servers:
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(10)


def jump_host(printed: str) -> str:
    """The login node a printed tunnel command jumps through: ``-J user@login``."""
    argv = shlex.split(printed)
    return argv[argv.index("-J") + 1].rpartition("@")[2]


@contextlib.contextmanager
def tunnel(printed: str, config: Path, local_port: int) -> Iterator[None]:
    """Run the tunnel command as printed (``ssh -N -L ...``), the client's settings from ``config``."""
    argv = shlex.split(printed)
    assert argv[0] == "ssh", printed
    proc = subprocess.Popen([argv[0], "-F", str(config), *argv[1:]], stderr=subprocess.PIPE)
    try:
        opened = waits.until(
            lambda: _listens("127.0.0.1", local_port) or (None if proc.poll() is None else "exited"),
            timeout_s=30,
            every_s=0.2,
        )
        if opened is not True:
            err = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
            raise AssertionError(f"the tunnel {printed!r} did not open: {err}")
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
