"""The worker registry: which worker processes serve a study, on which hosts, doing what.

Each worker process registers one row (storage/tables.py ``WorkerRecord``) and a heartbeat
thread stamps it with the database clock. `hpsearch status` reads the rows back as live,
finished or lost workers and sums the device time they spent.

The heartbeat borrows the process's one pooled connection when the trainer is not using it,
so the registry adds no connection per worker (the issue's target: <= 1.25 per process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from types import TracebackType
from typing import Any

from sqlalchemy import case, delete, event, func, select, update
from sqlalchemy.orm import Session

from hpsearch.storage.db import Database
from hpsearch.storage.errors import StorageError
from hpsearch.storage.tables import WorkerRecord

log = logging.getLogger(__name__)

HOST_ENV = "HPSEARCH_HOST"
HEARTBEAT_ENV = "HPSEARCH_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0
MISSED_BEATS = 3
"""A worker is lost after this many missed heartbeats (one late beat is normal under load)."""


def this_host() -> str:
    """This host's name as the registry and trials record it.

    ``$HPSEARCH_HOST`` overrides the system name: containers and cloned cloud images often
    share one hostname, and two instances must not look like one host.
    """
    return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


def heartbeat_interval() -> float:
    text = os.environ.get(HEARTBEAT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_HEARTBEAT_S
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning(
            "%s=%r is not a positive number of seconds; using %g",
            HEARTBEAT_ENV,
            text,
            DEFAULT_HEARTBEAT_S,
        )
        return DEFAULT_HEARTBEAT_S
    return value


def register(
    db: Database,
    study: str,
    name: str,
    device: str,
    *,
    host: str | None = None,
    pid: int | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
) -> int:
    """Add this worker process to the study's registry; returns its row id."""

    def add(s: Session) -> int:
        now = s.execute(select(db.clock())).scalar_one()
        row = WorkerRecord(
            study_name=study,
            name=name,
            host=host or this_host(),
            device=device,
            pid=os.getpid() if pid is None else pid,
            started_at=now,
            heartbeat_at=now,
            heartbeat_s=heartbeat_s,
            trials_finished=0,
            device_seconds=0.0,
        )
        s.add(row)
        s.flush()
        return row.id

    return db.run(add, what="register worker")


def beat(db: Database, worker_id: int) -> None:
    _update(db, worker_id, "heartbeat", heartbeat_at=db.clock())


def trial_started(db: Database, worker_id: int, trial_number: int) -> None:
    clock = db.clock()
    _update(
        db,
        worker_id,
        "record trial start",
        current_trial=trial_number,
        trial_started_at=clock,
        heartbeat_at=clock,
    )


def trial_ended(db: Database, worker_id: int, *, finished: bool = True) -> None:
    """The current trial ended: add its device time; ``finished=False`` for a handed-back one."""
    clock = db.clock()
    _update(
        db,
        worker_id,
        "record trial end",
        device_seconds=device_seconds_at(clock),
        trials_finished=WorkerRecord.trials_finished + (1 if finished else 0),
        current_trial=None,
        trial_started_at=None,
        heartbeat_at=clock,
    )


def device_seconds_at(clock: Any) -> Any:
    """The worker's device time including the current trial's, as a SQL expression.

    A worker killed before its first heartbeat inside a trial has its clock (that heartbeat)
    earlier than the trial's start: that trial adds nothing rather than negative time."""
    elapsed = func.coalesce(clock - WorkerRecord.trial_started_at, 0.0)
    return WorkerRecord.device_seconds + case((elapsed > 0, elapsed), else_=0.0)


def end(db: Database, worker_id: int) -> None:
    """The worker stops cleanly; a trial still marked current counts its time, not as finished."""
    clock = db.clock()
    _update(
        db,
        worker_id,
        "record worker end",
        device_seconds=device_seconds_at(clock),
        current_trial=None,
        trial_started_at=None,
        heartbeat_at=clock,
        ended_at=clock,
    )


def forget_study(db: Database, study: str) -> int:
    """Remove every row left under ``study``: a study of that name is being created anew (see
    ``slots.forget_study``); a deleted study's workers must not count as the new one's."""
    return int(
        db.run(
            lambda s: s.execute(delete(WorkerRecord).where(WorkerRecord.study_name == study)).rowcount,
            what="remove a deleted study's worker rows",
        )
    )


def held_trials(db: Database, study: str) -> set[int]:
    """The trials that workers not known to have ended hold (live or lost ones)."""
    rows = db.run(
        lambda s: s.execute(
            select(WorkerRecord.current_trial).where(
                WorkerRecord.study_name == study,
                WorkerRecord.ended_at.is_(None),
                WorkerRecord.current_trial.is_not(None),
            )
        ).all(),
        what="read the trials workers hold",
    )
    return {int(r[0]) for r in rows}


def _update(db: Database, worker_id: int, what: str, **values: Any) -> None:
    stmt = update(WorkerRecord).where(WorkerRecord.id == worker_id).values(**values)
    db.run(lambda s: s.execute(stmt), what=what)


class Registration:
    """A worker process's registry row and the heartbeat that keeps it live.

    Use as a context manager around the worker loop: it registers on entry and, on exit,
    stops the heartbeat and records a clean end. A process that dies without exiting the
    block stops beating and shows as lost after ``MISSED_BEATS`` intervals.

    The heartbeat must not cost a connection. A worker process has one pooled connection,
    and whichever thread finds it taken opens an overflow one, so the beat avoids taking it
    while the trainer may want it:

    * when a beat is due and the trainer is using storage, the beat rides along: it is
      written on the trainer's own connection as that connection goes back to the pool
      (a ``checkin`` event, one short UPDATE);
    * when the trainer leaves storage alone (a long training stretch between validations),
      the heartbeat thread writes the beat itself on the idle pooled connection.
    """

    def __init__(
        self,
        db: Database,
        study: str,
        name: str,
        device: str,
        *,
        interval_s: float | None = None,
        quiet_wait_s: float = 5.0,
    ) -> None:
        self.db, self.study, self.name, self.device = db, study, name, device
        self.interval_s = heartbeat_interval() if interval_s is None else interval_s
        self.quiet_wait_s = quiet_wait_s
        self.id: int | None = None
        self.beats = 0
        self._due = threading.Event()
        self._writing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_sql = ""
        self._piggyback = False
        self._last_write = 0.0

    def __enter__(self) -> Registration:
        began = time.monotonic()
        self.id = register(self.db, self.study, self.name, self.device, heartbeat_s=self.interval_s)
        self._last_write = began
        stmt = update(WorkerRecord).where(WorkerRecord.id == self.id).values(heartbeat_at=self.db.clock())
        self._beat_sql = str(stmt.compile(dialect=self.db.engine.dialect, compile_kwargs={"literal_binds": True}))
        # SQLite is one host's file: connections cost nothing there, and a beat written at
        # check-in could make the trainer wait on the file's write lock.
        self._piggyback = self.db.engine.dialect.name != "sqlite"
        if self._piggyback:
            event.listen(self.db.engine, "checkin", self._on_checkin)
        self._thread = threading.Thread(target=self._beat_loop, name="hpsearch-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            # A beat in flight on a dead network path ends only when the connection is
            # declared dead; a stopping worker that gave the database up does not wait for it.
            wait = 1.0 if self.db.given_up else self.interval_s + self.quiet_wait_s + 5
            self._thread.join(timeout=wait)
        if self._piggyback:
            event.remove(self.db.engine, "checkin", self._on_checkin)
        if self.id is None:
            return
        try:
            end(self.db, self.id)
        except StorageError as err:
            # The worker's own result is already stored; a missing end mark only makes the
            # registry call it lost later, so do not turn a clean exit into a failure.
            log.warning("could not record the end of worker %s: %s", self.name, err)

    def trial_started(self, number: int) -> None:
        assert self.id is not None, "use Registration as a context manager"
        began = time.monotonic()
        trial_started(self.db, self.id, number)
        self._last_write = began  # stands for this interval's beat (see _beat_loop)

    def trial_ended(self, *, finished: bool = True) -> None:
        assert self.id is not None, "use Registration as a context manager"
        began = time.monotonic()
        trial_ended(self.db, self.id, finished=finished)
        self._last_write = began

    def _on_checkin(self, dbapi_connection: Any, _record: Any) -> None:
        """Write a due beat on a connection going back to the pool (any thread)."""
        if dbapi_connection is None or not self._due.is_set():
            return
        if not self._writing.acquire(blocking=False):
            return
        try:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(self._beat_sql)
            finally:
                cursor.close()
            dbapi_connection.commit()
            self._due.clear()
            self.beats += 1
            self._last_write = time.monotonic()
        except Exception as err:  # a broken connection is the pool's business, not ours
            log.debug("heartbeat on check-in failed (%s); the heartbeat thread retries", err)
            with contextlib.suppress(Exception):
                dbapi_connection.rollback()
        finally:
            self._writing.release()

    def _beat_loop(self) -> None:
        # Each beat is due one interval after the row's last stamp, whoever wrote it: a fixed
        # tick that skipped the beat a trial start or end had just replaced let the row age to
        # nearly two intervals (a start just after a tick skips the next one).
        failed_at = -float("inf")
        while True:
            due = max(self._last_write, failed_at) + self.interval_s
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            if time.monotonic() - self._last_write < self.interval_s:
                continue  # a trial start or end stamped the row meanwhile: due later
            self._due.set()
            if not self._wait_for_quiet_connection():
                continue  # the trainer's next check-in carried the beat, or we are stopping
            with self._writing:
                if not self._due.is_set():
                    continue
                began = time.monotonic()
                try:
                    assert self.id is not None
                    beat(self.db, self.id)
                    self._due.clear()
                    self.beats += 1
                    self._last_write = began  # the row shows when the write began, at the latest
                except StorageError as err:
                    # Retries already happened inside; the next beat, an interval on, may get through.
                    log.warning("heartbeat of worker %s failed: %s", self.name, err)
                    failed_at = time.monotonic()

    def _wait_for_quiet_connection(self) -> bool:
        """True when the heartbeat should write the beat itself.

        That is when the pooled connection stays idle for a few polls in a row (the trainer is
        busy computing, not storing), or when ``quiet_wait_s`` runs out; False when a check-in
        carried the beat meanwhile or the worker is stopping.
        """
        deadline = time.monotonic() + self.quiet_wait_s
        quiet = 0
        while self._due.is_set() and time.monotonic() < deadline:
            quiet = quiet + 1 if self.db.pooled_connection_idle() else 0
            if quiet >= 3:
                return True
            if self._stop.wait(0.02):
                return False
        return self._due.is_set()
