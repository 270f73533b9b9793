"""Reaping: a trial whose worker vanished (host shut down, network cut) is failed and retried.

A crashed child on a live host is handed back at once by its supervisor (dispatch.py). When
the whole host goes, nobody is left to do that, so the trial's registry row stops beating.
Every worker runs a ``Reaper`` thread, and `hpsearch reap` runs one pass by hand: a trial
whose worker's heartbeat is older than the grace period (by the database clock) is marked
failed and queued again, resuming from the last resumable checkpoint it recorded when the
retrying host can reach that path (the same instance after a restart, or a shared disk).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from hpsearch.search import outcome
from hpsearch.search.outcome import Outcome
from hpsearch.storage import lost, registry, slots
from hpsearch.storage.errors import StorageError
from hpsearch.storage.open import Storage

log = logging.getLogger(__name__)

WORKER_LOST = "worker_lost"
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
    orphans: bool = False,
    stale: bool = True,
    watched_since: float | None = None,
) -> list[Reaped]:
    """One pass: fail and retry every trial whose worker is past the grace period.

    ``orphans`` also looks at trial slots whose worker vanished before the registry knew its
    trial (a window of milliseconds); that scan reads every slot, so the background reaper
    leaves it to `hpsearch reap` and to workers that find the budget used up. ``stale=False``
    skips the heartbeat rows: only a reaper that knows its own connection was healthy for a
    whole grace period (``Reaper``, or ``reap_by_hand``) should judge those; ``watched_since``
    is when that began (see ``lost.stale_trials``).
    """
    with _ONE_PASS:
        return _reap(storage, study_name, max_retries, grace_s, orphans, stale, watched_since)


def _reap(
    storage: Storage,
    study_name: str,
    max_retries: int,
    grace_s: float | None,
    orphans: bool,
    stale: bool,
    watched_since: float | None,
) -> list[Reaped]:
    stale_rows = (
        lost.stale_trials(storage.db, study_name, grace_s=grace_s, watched_since=watched_since) if stale else []
    )
    if not stale_rows and not orphans:
        return []
    study = optuna.load_study(study_name=study_name, storage=storage.optuna)
    reaped = []
    for s in stale_rows:
        # Of several reapers (every worker runs one), exactly one wins each trial.
        if lost.release_stale(storage.db, s):
            why = f"worker {s.worker} on {s.host} has not beaten for {s.heartbeat_age_s:.0f}s"
            reaped += _retry_stale(storage, study, s, max_retries, why)
    if not orphans:
        return reaped
    # By default the slowest worker's own interval, not this process's: a reaper that beats
    # faster must not judge a slot a worker claimed a moment ago (a window of milliseconds,
    # so a grace given by hand stands).
    grace = grace_s if grace_s is not None else registry.MISSED_BEATS * lost.longest_interval(storage.db, study_name)
    running_trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    running = {t.number for t in running_trials}
    for number in _unbound(storage, study_name, running_trials, grace):
        retried = _fail_for_retry(storage, study, number, max_retries)
        if retried is not None:
            log.warning("trial %d: its worker vanished as it asked for the trial; failing it for a retry", number)
            reaped.append(Reaped(number, "unknown", "unknown", grace, retried))
    for slot, number in slots.orphaned_slots(storage.db, study_name, older_than_s=grace):
        if number is not None and number not in running:
            continue  # a finished trial keeps its slot
        if number is None:
            log.warning("trial slot %d was claimed by a worker that vanished before its trial began", slot)
            slots.release_slot(storage.db, study_name, slot=slot)
            continue
        retried = _fail_for_retry(storage, study, number, max_retries)
        if retried is not None:
            log.warning("trial %d: its worker vanished as the trial began; failing it for a retry", number)
            reaped.append(Reaped(number, "unknown", "unknown", grace, retried))
    return reaped


def reap_by_hand(
    storage: Storage, study_name: str, *, max_retries: int, grace_s: float | None = None, poll_s: float = 1.0
) -> list[Reaped]:
    """`hpsearch reap`: one pass, with the background ``Reaper``'s guard.

    Right after an outage every heartbeat is old: the workers' beats could not reach the
    database, and they beat again within an interval of its return. So a worker's silence
    counts only from when this process saw its own connection answer promptly, and a row that
    looks stale is watched until it has been silent for its whole grace since then (up to
    3 of its interval); a beat meanwhile keeps its trial. A slow answer (the storage layer
    retrying through an outage) starts the watch again.
    """
    reaped = reap_gone_here(storage, study_name, max_retries=max_retries)
    since: float | None = None
    told = False
    while True:
        began = time.monotonic()
        now = storage.db.now()
        if since is None or time.monotonic() - began > poll_s:
            since = now
        reaped += reap(storage, study_name, max_retries=max_retries, grace_s=grace_s, watched_since=since)
        waiting = lost.stale_trials(storage.db, study_name, grace_s=grace_s)
        if not waiting:
            break
        if not told:
            log.warning(
                "trial(s) %s: their workers are silent; watching them for up to %.0fs, as after an outage "
                "every heartbeat is old and live workers beat again within an interval",
                ", ".join(str(w.trial_number) for w in waiting),
                registry.MISSED_BEATS * lost.longest_interval(storage.db, study_name),
            )
            told = True
        time.sleep(poll_s)
    return reaped + reap(storage, study_name, max_retries=max_retries, grace_s=grace_s, orphans=True, stale=False)


def reap_gone_here(storage: Storage, study_name: str, *, max_retries: int) -> list[Reaped]:
    """Fail and retry the trials of this host's workers whose process is gone, and end their rows.

    A worker starting on a host that an earlier start left without a word (killed with its
    instance, or stopped while the database was away) resumes that start's trials first, at
    once, instead of a reaper's grace later (see ``lost.end_gone``).
    """
    gone = lost.end_gone(storage.db, study_name, host=registry.this_host(), gone=_process_gone)
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
    except PermissionError:
        return False  # exists, under another user
    return False


def _retry_stale(storage: Storage, study: optuna.Study, s: lost.StaleTrial, max_retries: int, why: str) -> list[Reaped]:
    log.warning("trial %d: %s; failing it for a retry", s.trial_number, why)
    retried = _fail_for_retry(storage, study, s.trial_number, max_retries, device_seconds=s.device_seconds)
    return [] if retried is None else [Reaped(s.trial_number, s.worker, s.host, s.heartbeat_age_s, retried)]


def _unbound(storage: Storage, study_name: str, running: list[optuna.trial.FrozenTrial], grace: float) -> list[int]:
    """Running trials that no trial slot and no live registry row name, older than ``grace``.

    A worker that dies between ``ask()`` and binding the trial to its slot (milliseconds)
    leaves such a trial. Its age is judged by its start time, which the asking host's clock
    wrote (Optuna's); a grace of minutes dwarfs the drift of synchronised clocks.
    """
    if not running:
        return []
    named = slots.bound_trials(storage.db, study_name) | registry.held_trials(storage.db, study_name)
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=grace)
    return [
        t.number
        for t in running
        if t.number not in named and t.datetime_start is not None and t.datetime_start < cutoff
    ]


def _fail_for_retry(
    storage: Storage, study: optuna.Study, number: int, max_retries: int, *, device_seconds: float | None = None
) -> bool | None:
    """Hand a running trial back for a retry; None if it is not running (its supervisor already
    handed it back, or it finished in time: nothing to do).

    A trial may finish while the reaper works on it (its worker was slow, not gone, and told
    its result between our read and our write): that is no error, and the pass goes on."""
    study_id = storage.optuna.get_study_id_from_name(study.study_name)
    trial_id = storage.optuna.get_trial_id_from_study_id_trial_number(study_id, number)
    try:
        # No folder: the resumable state it recorded may be on another host (take_over checks it).
        return outcome.finish(storage, study, trial_id, Outcome.LOST, max_retries=max_retries, spent=device_seconds)
    except RuntimeError as err:  # optuna's UpdateFinishedTrialError among them
        log.warning("trial %d finished while being reaped; leaving it as it is (%s)", number, err)
        return None


class Reaper:
    """A worker's background reaper: one pass every third of a heartbeat interval.

    It only reaps once its own connection to the database has been healthy for a whole grace
    period. After a database outage every worker's heartbeat is old at once; reaping then
    would fail trials that are training fine and are about to beat again.
    """

    def __init__(self, storage: Storage, study_name: str, *, max_retries: int, interval_s: float) -> None:
        self.storage, self.study_name, self.max_retries = storage, study_name, max_retries
        self.poll_s = interval_s / 3
        self.grace_s = registry.MISSED_BEATS * interval_s
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
        healthy_since: float | None = None
        watched_since = 0.0  # the same moment by the database clock
        while not self._stop.wait(self.poll_s):
            began = time.monotonic()
            try:
                db_now = self.storage.db.now()
            except StorageError:
                healthy_since = None
                continue
            now = time.monotonic()
            # A slow answer means the storage layer was retrying through an outage.
            if healthy_since is None or now - began > self.poll_s:
                healthy_since, watched_since = now, db_now
            if now - healthy_since < self.grace_s:
                continue
            try:
                # Silence counts from then: a worker that beats slower than this one has a longer
                # grace than the wait above, and its row is as old as the outage too.
                reap(self.storage, self.study_name, max_retries=self.max_retries, watched_since=watched_since)
            except StorageError as err:
                log.warning("reaping stale trials failed: %s", err)
                healthy_since = None
            except Exception:
                # A thread that dies leaves its worker's study without a reaper, silently.
                log.exception("reaping stale trials failed; the next pass tries again")
