"""Lost workers: rows that stopped beating without a clean end (killed, host gone, network cut), judged by the
database clock against each worker's own interval. A trial taken off such a row counts its time up to the last beat."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from hpsearch.storage.db import Database
from hpsearch.storage.registry import MISSED_BEATS, heartbeat_interval, holding, off_trial
from hpsearch.storage.tables import WorkerRecord

log = logging.getLogger(__name__)


def end_dead(db: Database, study: str, *, host: str, pid: int) -> int | None:
    """A worker process its supervisor saw die: end its row at its last heartbeat (else it would turn "lost" and
    wait for a reaper). Returns the trial the row held, which the worker may not have told its supervisor of."""
    where = (
        WorkerRecord.study_name == study,
        WorkerRecord.host == host,
        WorkerRecord.pid == pid,
        WorkerRecord.ended_at.is_(None),
    )
    stmt = update(WorkerRecord).where(*where).values(**_at_last_beat())

    def record(s: Session) -> int | None:
        held = s.execute(select(WorkerRecord.current_trial).where(*where)).scalars().first()
        s.execute(stmt)
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
    device_seconds: float = 0.0  # the trial's device time up to the last heartbeat, times the worker's devices


def stale_trials(
    db: Database,
    study: str,
    *,
    grace_s: float | None = None,
    missed_beats: float = MISSED_BEATS,
    watched_since: float | None = None,
) -> list[StaleTrial]:
    """Trials held by workers whose last heartbeat is older than the grace period: ``missed_beats`` of the interval
    each worker recorded (workers may beat slower than this process's ``$HPSEARCH_HEARTBEAT_S``), or ``grace_s``
    where longer. Silence counts only from ``watched_since`` (database clock), when the caller's own connection was
    last known healthy: a database that was away kept every beat out."""

    def read(s: Session) -> list[StaleTrial]:
        now = float(s.execute(select(db.clock())).scalar_one())
        stale = []
        for r in s.execute(select(WorkerRecord).where(*holding(study))).scalars():
            own = missed_beats * r.heartbeat_s
            grace = own if grace_s is None else max(own, grace_s)
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
            since = r.heartbeat_at if watched_since is None else max(r.heartbeat_at, watched_since)
            if now - since > grace:
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


def silent(r: WorkerRecord, now: float, grace_s: float) -> bool:
    """No heartbeat from the row's worker for longer than ``grace_s`` (by the database clock)."""
    return now - r.heartbeat_at > grace_s


def _stale(r: WorkerRecord, now: float) -> StaleTrial:
    assert r.current_trial is not None
    return StaleTrial(
        worker_id=r.id,
        worker=r.name,
        host=r.host,
        trial_number=int(r.current_trial),
        heartbeat_at=r.heartbeat_at,
        heartbeat_age_s=now - r.heartbeat_at,
        device_seconds=max(0.0, r.heartbeat_at - (r.trial_started_at or r.heartbeat_at)) * r.devices,
    )


def end_gone(db: Database, study: str, *, host: str, gone: Callable[[int], bool]) -> list[StaleTrial]:
    """End the lost rows of ``host``'s workers whose process is ``gone`` (a start killed with its instance, or
    stopped while the database was away); the trials they held. After an outage a reaper cannot tell a dead worker
    from a silent one; the host can. Only stale rows still: a live worker elsewhere with this host's name beats."""

    def end(s: Session) -> list[StaleTrial]:
        now = float(s.execute(select(db.clock())).scalar_one())
        rows = s.execute(
            select(WorkerRecord).where(
                WorkerRecord.study_name == study, WorkerRecord.host == host, WorkerRecord.ended_at.is_(None)
            )
        ).scalars()
        held = []
        for r in list(rows):
            if not silent(r, now, MISSED_BEATS * r.heartbeat_s) or not gone(r.pid):
                continue
            trial = _stale(r, now) if r.current_trial is not None else None
            # Only while the row shows the heartbeat judged stale: of two workers ending it, one wins.
            ended = s.execute(  # type: ignore[attr-defined]  # an UPDATE's result has a rowcount
                update(WorkerRecord)
                .where(
                    WorkerRecord.id == r.id,
                    WorkerRecord.heartbeat_at == r.heartbeat_at,
                    WorkerRecord.ended_at.is_(None),
                )
                .values(**_at_last_beat())
            ).rowcount
            if ended == 1 and trial is not None:
                held.append(trial)
        return held

    return db.run(end, what="end the rows of this host's workers that are gone")


def release_stale(db: Database, stale: StaleTrial) -> bool:
    """Take a stale trial off its worker's row; True for exactly one caller: the update matches only while the row
    shows the heartbeat judged stale, so a worker that beat again keeps its trial, and of two reapers one wins."""
    stmt = (
        update(WorkerRecord)
        .where(
            WorkerRecord.id == stale.worker_id,
            WorkerRecord.current_trial == stale.trial_number,
            WorkerRecord.heartbeat_at == stale.heartbeat_at,
            WorkerRecord.ended_at.is_(None),
        )
        .values(**off_trial(WorkerRecord.heartbeat_at))
    )
    return bool(db.run(lambda s: s.execute(stmt).rowcount, what="release a stale trial") == 1)


def _at_last_beat() -> dict[str, object]:
    """A row ended at its last heartbeat, its trial taken off it: as far as anyone knows, its device stopped then."""
    return {**off_trial(WorkerRecord.heartbeat_at), "ended_at": WorkerRecord.heartbeat_at}
