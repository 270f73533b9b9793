"""The worker registry: one row per worker process (``WorkerRecord``), stamped by a heartbeat thread with the
database clock on the process's one pooled connection (docs/decisions.md, "One connection per worker process")."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from sqlalchemy import delete, event, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from hpsearch.storage import ledger
from hpsearch.storage.db import Database
from hpsearch.storage.errors import StorageError
from hpsearch.storage.tables import Attempt, WorkerRecord

log = logging.getLogger(__name__)

HOST_ENV = "HPSEARCH_HOST"
HEARTBEAT_ENV = "HPSEARCH_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0


def this_host() -> str:
    """This host's name as the registry and trials record it: ``$HPSEARCH_HOST`` overrides the system's, since
    containers and cloned cloud images often share one hostname."""
    return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


def heartbeat_interval() -> float:
    text = os.environ.get(HEARTBEAT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_HEARTBEAT_S
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning("%s=%r is not a positive number of seconds; using %g", HEARTBEAT_ENV, text, DEFAULT_HEARTBEAT_S)
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
        )
        s.add(row)
        s.flush()
        return row.id

    return db.run(add, what="register worker")


def beat(db: Database, worker_id: int) -> None:
    _update(db, worker_id, "heartbeat", heartbeat_at=db.clock())


def trial_started(db: Database, worker_id: int, trial_number: int) -> None:
    """The row takes the trial, and the trial's attempt opens in the ledger, in one transaction."""

    def start(s: Session) -> None:
        clock = float(s.execute(select(db.clock())).scalar_one())
        row = s.get_one(WorkerRecord, worker_id)
        row.current_trial, row.heartbeat_at = trial_number, clock
        ledger.open_attempt(s, row, trial_number, clock)

    db.run(start, what="record trial start")


def trial_ended(db: Database, worker_id: int, *, finished: bool = True) -> None:
    """The current trial ended (``finished=False``: handed back); its attempt, if still open, closes now."""
    count = WorkerRecord.trials_finished + int(finished)
    _update(db, worker_id, "record trial end", current_trial=None, trials_finished=count, heartbeat_at=db.clock())


def end(db: Database, worker_id: int) -> None:
    """The worker stops cleanly; a trial still marked current is taken off it, not as finished."""
    clock = db.clock()
    _update(db, worker_id, "record worker end", current_trial=None, heartbeat_at=clock, ended_at=clock)


def forget_study(db: Database, study: str) -> int:
    """Remove every row left under ``study``, which is being created anew (see ``slots.forget_study``), and its
    attempts: a new study of the same name starts with no device time used."""

    def forget(s: Session) -> int:
        s.execute(delete(Attempt).where(Attempt.study_name == study))
        return int(s.execute(delete(WorkerRecord).where(WorkerRecord.study_name == study)).rowcount)  # type: ignore[attr-defined]

    return db.run(forget, what="remove a deleted study's worker rows")


def held_trials(db: Database, study: str) -> set[int]:
    """The trials that workers not known to have ended hold (live or lost ones)."""
    stmt = select(WorkerRecord.current_trial).where(*holding(study))
    return {int(n) for n in db.run(lambda s: s.scalars(stmt).all(), what="read the trials workers hold")}


def holding(study: str) -> tuple[ColumnElement[bool], ...]:
    """The where-clause of the study's rows that hold a trial and are not known to have ended (live or lost)."""
    return (WorkerRecord.study_name == study, WorkerRecord.ended_at.is_(None), WorkerRecord.current_trial.is_not(None))


def _update(db: Database, worker_id: int, what: str, **values: Any) -> None:
    """Update the row; a trial taken off it (``current_trial=None``) has its attempt closed at the same clock."""
    stmt = update(WorkerRecord).where(WorkerRecord.id == worker_id).values(**values)

    def write(s: Session) -> None:
        if "current_trial" in values:
            s.execute(ledger.close(WorkerRecord.id == worker_id, values["heartbeat_at"]))
        s.execute(stmt)

    db.run(write, what=what)


class Registration:
    """A worker process's registry row and the heartbeat that keeps it live, as a context manager around the
    worker loop: it registers on entry and records a clean end on exit (a process that dies shows as lost).

    The beat must not cost a connection, so it avoids taking the pooled one while the trainer may want it: a
    due beat rides along on the trainer's connection as it goes back to the pool (a ``checkin`` event), and
    when the trainer leaves storage alone, the heartbeat thread writes it on the idle pooled connection.
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
        self._thread = threading.Thread(target=self._beat_loop, name="hpsearch-heartbeat", daemon=True)
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
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        # A beat in flight on a dead network path ends only when the connection is
        # declared dead; a stopping worker that gave the database up does not wait for it.
        self._thread.join(timeout=1.0 if self.db.given_up else self.interval_s + self.quiet_wait_s + 5)
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

    def _beaten(self, at: float) -> None:
        self._due.clear()
        self.beats += 1
        self._last_write = at

    def _on_checkin(self, dbapi_connection: Any, _record: Any) -> None:
        """Write a due beat on a connection going back to the pool (any thread)."""
        if dbapi_connection is None or not self._due.is_set() or not self._writing.acquire(blocking=False):
            return
        try:
            with contextlib.closing(dbapi_connection.cursor()) as cursor:
                cursor.execute(self._beat_sql)
            dbapi_connection.commit()
            self._beaten(time.monotonic())
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
                    self._beaten(began)  # the row shows when the write began, at the latest
                except StorageError as err:
                    # Retries already happened inside; the next beat, an interval on, may get through.
                    log.warning("heartbeat of worker %s failed: %s", self.name, err)
                    failed_at = time.monotonic()

    def _wait_for_quiet_connection(self) -> bool:
        """True when the heartbeat should write the beat itself: the pooled connection stayed idle for a few polls
        in a row, or ``quiet_wait_s`` ran out; False when a check-in carried the beat or the worker is stopping."""
        deadline = time.monotonic() + self.quiet_wait_s
        quiet = 0
        while self._due.is_set() and time.monotonic() < deadline:
            quiet = quiet + 1 if self.db.pooled_connection_idle() else 0
            if quiet >= 3:
                return True
            if self._stop.wait(0.02):
                return False
        return self._due.is_set()
