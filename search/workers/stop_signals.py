"""How a worker notices that it must stop: a signal, its supervisor gone, or its storage gone.

Either way the trial is not the worker's to finish: it stops and lets the trial be handed back (by the
supervisor, or by a reaper once the storage answers again), instead of training on unsupervised or failing it."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any

from hpsearch.storage.db import RetryPolicy, one_line, retrying
from hpsearch.storage.errors import StorageError, StudyNotFoundError
from hpsearch.storage.open import Storage, open_storage

log = logging.getLogger(__name__)


class StorageLost(Exception):
    """The storage stayed unreachable past its retries while this worker held a trial: not the trial's fault.
    The worker exits without telling anything; its supervisor hands the trial back, or a reaper once it is back."""

    @classmethod
    def during(cls, trial_number: int, exc: BaseException) -> StorageLost:
        return cls(f"trial {trial_number}: storage unreachable ({describe(exc)})")


def is_storage_failure(exc: BaseException) -> bool:
    """An error of the storage (ours or Optuna's), after its own retries, not of the trial."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    from hpsearch.trainer.report import CallAbandoned

    return isinstance(exc, (StorageError, StorageInternalError, SQLAlchemyError, CallAbandoned))


def describe(exc: BaseException) -> str:
    """One line on a storage failure: the driver's words, not Optuna's wrapper text (which blames "invalid
    data in the commit" for a server that is simply down)."""
    from optuna.exceptions import StorageInternalError

    shown = exc.__cause__ if isinstance(exc, StorageInternalError) and exc.__cause__ else exc
    return one_line(shown)[:300]


PR_SET_PDEATHSIG = 1
PARENT_DIED = signal.SIGUSR1  # what the kernel sends a worker when its supervisor dies (see die_with_parent)
# What a supervisor that got SIGTERM passes on to its workers: a graceful stop only. Not SIGTERM: a shutdown
# (or `kill -TERM -PGID`) signals the whole group, and its own plus the forwarded one would mean "exit now".
STOP_REQUEST = signal.SIGUSR2


def die_with_parent() -> bool:
    """Have the kernel signal this worker when its supervisor dies (a SIGKILLed one cannot stop it, and an orphan
    would train with nobody to hand its trial back); False if it is gone already, even before prctl took effect."""
    parent = mp.parent_process()
    if parent is None:
        return True  # not a spawned child (run in-process by a test or a benchmark)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, PARENT_DIED, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    return os.getppid() == parent.pid


# After a stop request, how long storage calls still retry through an outage: a shutting-down instance has
# seconds, not OUTAGE_RETRY's minutes; the resumable state is on disk, resumed once the database is back.
STOP_OUTAGE_RETRY_S = 20.0


class StopFlag:
    """First SIGTERM/SIGINT: finish the step, checkpoint, hand the trial back. Second: exit now."""

    def __init__(self) -> None:
        self.requested, self.signum, self.requested_at = False, 0, 0.0
        self.signalled = False  # a SIGTERM or SIGINT came from outside (not the supervisor's forwarded request)

    def outage_retry_over(self) -> bool:
        return self.requested and time.monotonic() - self.requested_at > STOP_OUTAGE_RETRY_S

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        # Graceful stops, never the second signal's exit: the parent-death signal comes once per supervisor thread.
        signal.signal(PARENT_DIED, lambda *_: self.request(signal.SIGTERM, "the supervisor died"))
        signal.signal(STOP_REQUEST, lambda *_: self.request(signal.SIGTERM, "the supervisor is stopping"))

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signalled:
            os._exit(128 + signum)  # a second SIGTERM / Ctrl-C from outside: exit now
        self.signalled = True
        self.request(signum, f"received {signal.Signals(signum).name}")

    def request(self, signum: int, why: str) -> None:
        if not self.requested:
            self.requested, self.signum, self.requested_at = True, signum, time.monotonic()
            log.warning("%s: checkpointing and handing the trial back", why)

    def __call__(self) -> bool:
        return self.requested


def open_retrying(url: str, policy: RetryPolicy, stop: StopFlag) -> Storage | None:
    """The storage, waited for as every later call waits for it; None if a stop came first. The URL was checked
    a moment ago: a refused connection is an outage, and failing would count as a crash (3 give the device up)."""
    try:
        return retrying(
            lambda: open_storage(url, create=False, retry=policy),
            policy=replace(policy, give_up=stop),  # a stop ends the waits: no trial is held yet, nothing to hand back
            what="open the storage",
            transient=lambda e: isinstance(e, StorageError) and not isinstance(e, StudyNotFoundError),
        )
    except StudyNotFoundError:
        raise
    except StorageError as exc:
        if stop():
            return None
        raise StorageLost(f"storage unreachable since this worker started ({exc})") from exc
