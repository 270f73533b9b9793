"""A throwaway PostgreSQL cluster on its own port, for tests that restart the server.

Never the machine's shared server: fault tests stop and start this one at will.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.netns import Host

OS_USER = "hpsearch-pg"


class Cluster:
    def __init__(self, port: int | None = None, host: Host | None = None) -> None:
        """``host``: run the server inside that network namespace, listening on its address."""
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            raise RuntimeError("initdb not found (install the postgresql package)")
        self.bindir = Path(found[-1]).parent
        # A free port unless told: two test runs on one machine must not share a cluster.
        self.port = port if port is not None else free_port()
        self.root = Path(tempfile.mkdtemp(prefix="hpsearch-test-pg-"))
        self.data = self.root / "data"
        self.host = host
        self._frozen: list[int] = []
        self.address = host.address if host is not None else "127.0.0.1"
        self.as_user: list[str] = host.prefix() if host is not None else []
        if os.geteuid() == 0:
            # initdb refuses to run as root: the cluster runs as an unprivileged user.
            try:
                pwd.getpwnam(OS_USER)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", OS_USER], check=True)
            entry = pwd.getpwnam(OS_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.as_user += ["runuser", "-u", OS_USER, "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust")
        if host is not None:
            # initdb trusts only loopback; clients are the other end of the host's link and
            # the host itself.
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {host.peer}/32 trust\nhost all all {host.address}/32 trust\n")
        self.url = f"postgresql://postgres@{self.address}:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.as_user, str(self.bindir / tool), *args],
            check=True,
            capture_output=True,
            env={**os.environ, "LC_ALL": "C"},
        )

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses={self.address}"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "server.log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def freeze(self) -> None:
        """Stop the server's processes (SIGSTOP), as in a frozen VM: its kernel still accepts
        connections and acknowledges what clients send, but nothing ever answers."""
        # The postmaster first, so that it forks no new backend while the rest are listed; a
        # backend may still end between the listing and its signal (a client that hung up).
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGSTOP)
        self._frozen = [postmaster]
        for pid in self._children(postmaster):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self._frozen.append(pid)

    def thaw(self) -> None:
        for pid in self._frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = []

    @staticmethod
    def _children(postmaster: int) -> list[int]:
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                        children.append(int(entry.name))
        return children

    def destroy(self) -> None:
        self.thaw()
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
