"""A second "host" on this machine: a network namespace joined to this one by a veth pair.

Fault tests run a throwaway PostgreSQL cluster inside it and cut the path between the two
hosts the way a cloud network fails: silently, with no reset and no "unreachable" reply, so
every packet just goes unanswered. Stopping the server (what the other fault tests do) is the
kind failure: the worker's kernel hears about it at once. A partition is the unkind one.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess


def available() -> bool:
    """Whether this machine lets the tests make namespaces (root and iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"hpsearch-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


class Host:
    """A namespace at ``address``, reachable from this one (at ``peer``) until ``cut``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.name = f"hpsearch-{tag}"
        # A /30 of its own per test run, away from the ranges clouds and Docker hand out.
        net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.peer, self.address = f"{net}.1", f"{net}.2"
        self._here, self._there = f"hpo{tag}", f"hpi{tag}"
        self._both_ways = False
        self._ip("netns", "add", self.name)
        try:
            self._ip("link", "add", self._here, "type", "veth", "peer", "name", self._there)
            self._ip("link", "set", self._there, "netns", self.name)
            self._ip("addr", "add", f"{self.peer}/30", "dev", self._here)
            self._ip("link", "set", self._here, "up")
            self.run("ip", "addr", "add", f"{self.address}/30", "dev", self._there)
            self.run("ip", "link", "set", self._there, "up")
            self.run("ip", "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise

    def prefix(self) -> list[str]:
        """Put before a command to run it inside this host."""
        return ["ip", "netns", "exec", self.name]

    def run(self, *argv: str) -> None:
        subprocess.run([*self.prefix(), *argv], check=True, capture_output=True)

    def cut(self, *, both_ways: bool = False) -> None:
        """Drop every packet this host sends back: connections hang, none is refused or reset.

        ``both_ways``: also drop what this side sends it, as when this side's instance is
        gone; not even a closing connection's FIN gets through.
        """
        self.run("ip", "route", "add", "blackhole", f"{self.peer}/32")
        if both_ways:
            self._ip("route", "add", "blackhole", f"{self.address}/32")
        self._both_ways = both_ways

    def heal(self) -> None:
        self.run("ip", "route", "del", "blackhole", f"{self.peer}/32")
        if self._both_ways:
            self._ip("route", "del", "blackhole", f"{self.address}/32")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ip("route", "del", "blackhole", f"{self.address}/32")
        # Deleting the namespace deletes its end of the pair, and so the pair.
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ip("netns", "del", self.name)
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ip("link", "del", self._here)

    @staticmethod
    def _ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True)
