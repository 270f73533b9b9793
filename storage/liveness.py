"""Liveness, in one place: the one rule for when a worker is lost (``is_lost``: no clean end and no heartbeat
for longer than a few of its own intervals, by the database clock), and everything judged by it: the trials lost
workers hold (``stale_trials``, taken off their rows by ``release_stale``, one winner of several reapers), rows
ended by whoever saw their process die (``end_dead``, ``end_gone``), and the workers as `status` shows them
(``list_workers``). The reaper, `hpsearch reap`, `status` and the device-time ledger all call it. A trial taken off a
lost row has its attempt closed at the row's last heartbeat."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from hpsearch.storage import ledger
from hpsearch.storage.db import Database
from hpsearch.storage.registry import heartbeat_interval, holding
from hpsearch.storage.tables import WorkerRecord

log = logging.getLogger(__name__)

MISSED_BEATS = 3  # a worker is lost after this many missed heartbeats (one late beat is normal under load)


def is_lost(
    r: WorkerRecord,
    now: float,
    *,
    grace_s: float | None = None,
    missed_beats: float = MISSED_BEATS,
    watched_since: float | None = None,
) -> bool:
    """No clean end, and no heartbeat by ``now`` for longer than ``missed_beats`` of its own interval (``grace_s``
    where longer). Silence counts only from ``watched_since`` where given: when the judge's own connection was last
    known healthy (a database that was away kept every beat out)."""
    if r.ended_at is not None:
        return False
    since = r.heartbeat_at if watched_since is None else max(r.heartbeat_at, watched_since)
    return now - since > max(missed_beats * r.heartbeat_s, grace_s or 0.0)


def end_dead(db: Database, study: str, *, host: str, pid: int) -> int | None:
    """A worker process its supervisor saw die: end its row (else it would turn "lost" and wait for a reaper), its
    attempt closed now, when it died. Returns the trial the row held, which the worker may not have told its
    supervisor of."""
    where = (
        WorkerRecord.study_name == study,
        WorkerRecord.host == host,
        WorkerRecord.pid == pid,
        WorkerRecord.ended_at.is_(None),
    )

    def record(s: Session) -> int | None:
        held = s.execute(select(WorkerRecord.current_trial).where(*where)).scalars().first()
        _end(s, *where, at=db.clock())
        return None if held is None else int(held)

    return db.run(record, what="record a dead worker")


@dataclass(frozen=True)
class StaleTrial:
    """A trial whose worker stopped beating without a clean end."""

    worker_id: int
    worker: str
    host: str
    trial_number: int
    heartbeat_at: float
    heartbeat_age_s: float


def stale_trials(
    db: Database,
    study: str,
    *,
    grace_s: float | None = None,
    missed_beats: float = MISSED_BEATS,
    watched_since: float | None = None,
) -> list[StaleTrial]:
    """Trials held by workers ``is_lost`` judges lost, by its ``grace_s``, ``missed_beats`` (of the interval each
    worker recorded: workers may beat slower than this process's ``$HPSEARCH_HEARTBEAT_S``) and ``watched_since``."""

    def read(s: Session) -> list[StaleTrial]:
        now = float(s.execute(select(db.clock())).scalar_one())
        stale = []
        for r in s.execute(select(WorkerRecord).where(*holding(study))).scalars():
            own = missed_beats * r.heartbeat_s
            if grace_s is not None and grace_s < own and (r.id, grace_s) not in _CLAMPED:
                _CLAMPED.add((r.id, grace_s))  # once: `hpsearch reap` asks again every second while it watches
                log.warning(
                    "a grace of %gs is shorter than %g beats of worker %s's own interval (%gs): using %gs",
                    grace_s,
                    missed_beats,
                    r.name,
                    r.heartbeat_s,
                    own,
                )
            if is_lost(r, now, grace_s=grace_s, missed_beats=missed_beats, watched_since=watched_since):
                stale.append(_stale(r, now))
        return stale

    return db.run(read, what="find stale trials")


_CLAMPED: set[tuple[int, float]] = set()  # (row id, grace) pairs stale_trials has warned about


def longest_interval(db: Database, study: str) -> float:
    """The longest heartbeat interval the study's unended workers recorded (this process's if none)."""
    stmt = select(func.max(WorkerRecord.heartbeat_s)).where(
        WorkerRecord.study_name == study, WorkerRecord.ended_at.is_(None)
    )
    longest = db.run(lambda s: s.execute(stmt).scalar_one(), what="read the workers' heartbeat intervals")
    return heartbeat_interval() if longest is None else float(longest)


def _stale(r: WorkerRecord, now: float) -> StaleTrial:
    assert r.current_trial is not None
    return StaleTrial(
        worker_id=r.id,
        worker=r.name,
        host=r.host,
        trial_number=int(r.current_trial),
        heartbeat_at=r.heartbeat_at,
        heartbeat_age_s=now - r.heartbeat_at,
    )


def end_gone(db: Database, study: str, *, host: str, gone: Callable[[int], bool]) -> list[StaleTrial]:
    """End the lost rows of ``host``'s workers whose process is ``gone`` (a start killed with its instance, or
    stopped while the database was away); the trials they held. After an outage a reaper cannot tell a dead worker
    from a silent one; the host can. Only stale rows still: a live worker elsewhere with this host's name beats."""

    def end(s: Session) -> list[StaleTrial]:
        now = float(s.execute(select(db.clock())).scalar_one())
        unended = (WorkerRecord.study_name == study, WorkerRecord.host == host, WorkerRecord.ended_at.is_(None))
        held = []
        for r in s.scalars(select(WorkerRecord).where(*unended)).all():
            if not is_lost(r, now) or not gone(r.pid):
                continue
            trial = _stale(r, now) if r.current_trial is not None else None
            # Only while the row shows the heartbeat judged stale: of two workers ending it, one wins.
            ended = _end(
                s, WorkerRecord.id == r.id, WorkerRecord.heartbeat_at == r.heartbeat_at, WorkerRecord.ended_at.is_(None)
            )
            if ended == 1 and trial is not None:
                held.append(trial)
        return held

    return db.run(end, what="end the rows of this host's workers that are gone")


def release_stale(db: Database, stale: StaleTrial) -> bool:
    """Take a stale trial off its worker's row; True for exactly one caller: the update matches only while the row
    shows the heartbeat judged stale, so a worker that beat again keeps its trial, and of two reapers one wins."""
    where = (
        WorkerRecord.id == stale.worker_id,
        WorkerRecord.current_trial == stale.trial_number,
        WorkerRecord.heartbeat_at == stale.heartbeat_at,
        WorkerRecord.ended_at.is_(None),
    )

    def release(s: Session) -> bool:
        s.execute(ledger.close(and_(*where)))
        taken = s.execute(update(WorkerRecord).where(*where).values(current_trial=None))
        return bool(taken.rowcount == 1)  # type: ignore[attr-defined]  # an UPDATE's result has a rowcount

    return db.run(release, what="release a stale trial")


def _end(s: Session, *where: ColumnElement[bool], at: Any = None) -> int:
    """End the rows ``where`` selects at their last heartbeat, their trials' attempts closed ``at`` (by default that
    beat: as far as anyone knows, their devices stopped then). How many rows it ended."""
    s.execute(ledger.close(and_(*where), at))
    stmt = update(WorkerRecord).where(*where).values(current_trial=None, ended_at=WorkerRecord.heartbeat_at)
    return int(s.execute(stmt).rowcount)  # type: ignore[attr-defined]  # an UPDATE's result has a rowcount


@dataclass(frozen=True)
class WorkerView:
    """One registry row as `status` shows it."""

    name: str
    host: str
    device: str
    pid: int
    state: str  # "live", "finished" or "lost"
    started_at: float
    heartbeat_age_s: float  # seconds since the last heartbeat, by the database clock
    current_trial: int | None
    trials_finished: int
    device_seconds: float
    """The worker's attempts in the ledger (ledger.py), the running one included."""


def list_workers(db: Database, study: str) -> list[WorkerView]:
    """Every worker that ever served ``study``, oldest first, judged by the database clock."""

    def read(s: Session) -> list[WorkerView]:
        now = float(s.execute(select(db.clock())).scalar_one())
        rows = s.scalars(select(WorkerRecord).where(WorkerRecord.study_name == study).order_by(WorkerRecord.id))
        seconds: dict[int, float] = {}
        for x in ledger.spent(s, db, study):
            seconds[x.worker_id] = seconds.get(x.worker_id, 0.0) + x.seconds
        return [_view(r, now, seconds.get(r.id, 0.0)) for r in rows]

    return db.run(read, what="read worker registry")


def _view(r: WorkerRecord, now: float, seconds: float) -> WorkerView:
    state = "finished" if r.ended_at is not None else "lost" if is_lost(r, now) else "live"
    return WorkerView(
        name=r.name,
        host=r.host,
        device=r.device,
        pid=r.pid,
        state=state,
        started_at=r.started_at,
        heartbeat_age_s=max(0.0, now - r.heartbeat_at),
        current_trial=r.current_trial,
        trials_finished=r.trials_finished,
        device_seconds=seconds,
    )
