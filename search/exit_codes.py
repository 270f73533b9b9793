"""Every exit code an hpsearch process ends with: what the supervisor reads from a worker, a script from a command."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    """A command did not do what it was asked (every trial failed, a device gave up)."""
    USAGE = 2
    """Bad input (spec, data, model, storage URL, CLI): one line says what to fix; nothing was written."""
    PEER_DIED = 75
    """A worker's peer rank died: the supervisor hands the trial back, as for any crash."""
    GROUP_RESTART = 76
    """A failed trial left a device group's ranks out of step: the supervisor restarts the group."""
    STORAGE_LOST = 77
    """The worker could not reach the storage past its outage retries; its trial is retried once it is back."""
    OUT_OF_MEMORY = 78
    """A rank of a device group ran out of memory: the supervisor restarts the group, which starts with a smaller
    micro-batch (not a crash: the halving bounds these restarts)."""

    @staticmethod
    def signalled(signum: int) -> int:
        """The code of a process that ended on signal ``signum``, as shells report it (130 for Ctrl-C)."""
        return 128 + signum
