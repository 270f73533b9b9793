"""Reaping, one thing: failing and retrying the trials of lost workers (storage/liveness.py's rule: host shut
down, network cut). Every worker runs a ``Reaper`` thread that reaps; `hpsearch reap` reaps by hand (``by_hand``).

Two neighbours retry trials the registry cannot judge: ``retry_orphans`` (a worker that vanished before its row
named its trial) and ``retry_gone_here`` (this host's worker processes that are gone). A crashed child on a live
host is handed back by its supervisor (dispatch.py)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from hpsearch.search.workers import outcome, retry
from hpsearch.search.workers.outcome import Outcome
from hpsearch.storage import liveness, registry, slots
from hpsearch.storage.errors import StorageError
from hpsearch.storage.liveness import MISSED_BEATS
from hpsearch.storage.open import Storage

log = logging.getLogger(__name__)

# One pass at a time in a process: a worker's Reaper thread takes a stale trial off its row and
# then fails it with the lost worker's device time; a pass of the main thread in between (a
# worker that finds the budget used scans orphaned slots) would see the slot held by no row
# and fail the trial first, without that time.
_ONE_PASS = threading.RLock()


@dataclass(frozen=True)
class Reaped:
    trial_number: int
    worker: str
    host: str
    heartbeat_age_s: float
    retried: bool


def reap(
    storage: Storage,
    study_name: str,
    *,
    max_retries: int,
    grace_s: float | None = None,
    watched_since: float | None = None,
) -> list[Reaped]:
    """One pass: fail and retry every trial whose worker is lost. Silence counts from ``watched_since`` (database
    clock), when the caller's own connection was last known healthy (see ``Reaper``)."""
    with _ONE_PASS:
        stale_rows = liveness.stale_trials(storage.db, study_name, grace_s=grace_s, watched_since=watched_since)
        if not stale_rows:
            return []
        study = optuna.load_study(study_name=study_name, storage=storage.optuna)
        reaped = []
        for s in stale_rows:
            # Of several reapers (every worker runs one), exactly one wins each trial.
            if liveness.release_stale(storage.db, s):
                why = f"worker {s.worker} on {s.host} has not beaten for {s.heartbeat_age_s:.0f}s"
                reaped += _retry_stale(storage, study, s, max_retries, why)
        return reaped


def retry_orphans(storage: Storage, study_name: str, *, max_retries: int, grace_s: float | None = None) -> list[Reaped]:
    """Fail and retry the trials whose worker vanished before the registry knew them (it reads every slot: not
    for the background reaper), and free slots claimed by a worker that vanished before its trial began."""
    with _ONE_PASS:
        study = optuna.load_study(study_name=study_name, storage=storage.optuna)
        reaped = []
        # By default the slowest worker's own interval, not this process's: a reaper that beats faster must
        # not judge a slot a worker claimed a moment ago (a window of milliseconds: a grace given by hand stands).
        grace = grace_s if grace_s is not None else MISSED_BEATS * liveness.longest_interval(storage.db, study_name)

        def fail(number: int, when: str) -> None:
            retried = _fail_for_retry(storage, study, number, max_retries)
            if retried is not None:
                log.warning("trial %d: its worker vanished %s; failing it for a retry", number, when)
                reaped.append(Reaped(number, "unknown", "unknown", grace, retried))

        running_trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if running_trials:
            # Running trials no slot or live registry row names: their worker died between ask() and binding a slot.
            # Aged by the asking host's clock (Optuna's start time): a grace of minutes dwarfs clock drift.
            named = slots.bound_trials(storage.db, study_name) | registry.held_trials(storage.db, study_name)
            cutoff = datetime.datetime.now() - datetime.timedelta(seconds=grace)
            for t in running_trials:
                if t.number not in named and t.datetime_start is not None and t.datetime_start < cutoff:
                    fail(t.number, "as it asked for the trial")
        running = {t.number for t in running_trials}
        for slot, number in slots.orphaned_slots(storage.db, study_name, older_than_s=grace):
            if number is None:
                log.warning("trial slot %d was claimed by a worker that vanished before its trial began", slot)
                slots.release_slot(storage.db, study_name, slot=slot)
            elif number in running:  # a finished trial keeps its slot
                fail(number, "as the trial began")
        return reaped


def by_hand(
    storage: Storage, study_name: str, *, max_retries: int, grace_s: float | None = None, poll_s: float = 1.0
) -> list[Reaped]:
    """`hpsearch reap`: one pass, with the ``Reaper``'s guard: after an outage every heartbeat is old, so silence
    counts from this process's first prompt answer, and a stale-looking row is watched for its whole grace."""
    reaped = retry_gone_here(storage, study_name, max_retries=max_retries)
    guard = OutageGuard(poll_s)
    told = False
    while True:
        since = guard.answered(storage)
        reaped += reap(storage, study_name, max_retries=max_retries, grace_s=grace_s, watched_since=since)
        waiting = liveness.stale_trials(storage.db, study_name, grace_s=grace_s)
        if not waiting:
            break
        if not told:
            log.warning(
                "trial(s) %s: their workers are silent; watching them for up to %.0fs, as after an outage "
                "every heartbeat is old and live workers beat again within an interval",
                ", ".join(str(w.trial_number) for w in waiting),
                MISSED_BEATS * liveness.longest_interval(storage.db, study_name),
            )
            told = True
        time.sleep(poll_s)
    return reaped + retry_orphans(storage, study_name, max_retries=max_retries, grace_s=grace_s)


def retry_gone_here(storage: Storage, study_name: str, *, max_retries: int) -> list[Reaped]:
    """Fail and retry the trials of this host's workers whose process is gone, and end their rows: at once,
    not a reaper's grace later, for an earlier start killed with its instance (see ``liveness.end_gone``)."""
    gone = liveness.end_gone(storage.db, study_name, host=registry.this_host(), gone=_process_gone)
    if not gone:
        return []
    study = optuna.load_study(study_name=study_name, storage=storage.optuna)
    reaped = []
    for s in gone:
        reaped += _retry_stale(storage, study, s, max_retries, f"worker {s.worker} of this host is gone")
    return reaped


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, under another user
        pass
    return False


def _retry_stale(
    storage: Storage, study: optuna.Study, s: liveness.StaleTrial, max_retries: int, why: str
) -> list[Reaped]:
    log.warning("trial %d: %s; failing it for a retry", s.trial_number, why)
    retried = _fail_for_retry(storage, study, s.trial_number, max_retries)
    return [] if retried is None else [Reaped(s.trial_number, s.worker, s.host, s.heartbeat_age_s, retried)]


def _fail_for_retry(storage: Storage, study: optuna.Study, number: int, max_retries: int) -> bool | None:
    """Hand a running trial back for a retry; None if it is not running (handed back already, or finished
    in time). One that finishes while being reaped (a slow worker, not a gone one) is no error either."""
    trial_id = retry.trial_id(storage, study.study_name, number)
    try:
        # No folder: the resumable state it recorded may be on another host (take_over checks it).
        return outcome.finish(storage, study, trial_id, Outcome.LOST, max_retries=max_retries)
    except RuntimeError as err:  # optuna's UpdateFinishedTrialError among them
        log.warning("trial %d finished while being reaped; leaving it as it is (%s)", number, err)
        return None


class OutageGuard:
    """When silence may start to count, for a reaper and for `hpsearch reap` alike: after a database outage every
    heartbeat is old at once, so it counts from this process's first prompt answer of the database (a slow answer
    means the storage layer was retrying through an outage), not from the rows' own times."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.healthy_since: float | None = None  # this process's clock: since when the database answered promptly
        self.watched_since = 0.0  # the same moment by the database clock

    def answered(self, storage: Storage) -> float:
        """Ask the database its time (StorageError if it does not answer); since when silence counts, by its clock."""
        began = time.monotonic()
        try:
            db_now = storage.db.now()
        except StorageError:
            self.lost()
            raise
        now = time.monotonic()
        if self.healthy_since is None or now - began > self.poll_s:
            self.healthy_since, self.watched_since = now, db_now
        return self.watched_since

    def healthy_for(self) -> float:
        """Seconds the database has answered promptly (0 before ``answered``)."""
        return 0.0 if self.healthy_since is None else time.monotonic() - self.healthy_since

    def lost(self) -> None:
        self.healthy_since = None


class Reaper:
    """A worker's background reaper: one pass every third of a heartbeat interval, once its own connection
    has been healthy for a whole grace period (after an outage every heartbeat is old at once)."""

    def __init__(self, storage: Storage, study_name: str, *, max_retries: int, interval_s: float) -> None:
        self.storage, self.study_name, self.max_retries = storage, study_name, max_retries
        self.poll_s = interval_s / 3
        self.grace_s = MISSED_BEATS * interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpsearch-reaper", daemon=True)

    def __enter__(self) -> Reaper:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        # Not for a pass stuck on a database this stopping worker has given up on.
        self._thread.join(timeout=1.0 if self.storage.db.given_up else 30)

    def _loop(self) -> None:
        guard = OutageGuard(self.poll_s)
        while not self._stop.wait(self.poll_s):
            try:
                watched_since = guard.answered(self.storage)
            except StorageError:
                continue
            if guard.healthy_for() < self.grace_s:
                continue
            try:
                # Silence counts from then: a worker that beats slower than this one has a longer
                # grace than the wait above, and its row is as old as the outage too.
                reap(self.storage, self.study_name, max_retries=self.max_retries, watched_since=watched_since)
            except StorageError as err:
                log.warning("reaping stale trials failed: %s", err)
                guard.lost()
            except Exception:
                # A thread that dies leaves its worker's study without a reaper, silently.
                log.exception("reaping stale trials failed; the next pass tries again")
