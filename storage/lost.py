"""Lost workers: rows that stopped beating without a clean end (killed, host gone, network cut).

Silence is judged by the database clock, against the interval each worker recorded, and a
trial is taken off a silent row by exactly one caller (``release_stale``), who then hands it
back for a retry (search/reap.py). A row's trial taken off it counts its device time up to
the row's last heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from hpsearch.storage.db import Database
from hpsearch.storage.registry import MISSED_BEATS, device_seconds_at, heartbeat_interval
from hpsearch.storage.tables import WorkerRecord

log = logging.getLogger(__name__)


def end_dead(db: Database, study: str, *, host: str, pid: int) -> int | None:
    """A worker process its supervisor saw die: end its row at its last heartbeat.

    Returns the trial the row held, for the supervisor to hand back (it may have died
    between recording the trial here and telling its supervisor). Without this the row
    would turn "lost" with a current trial, and workers would wait for a reaper to clear it.
    """
    where = (
        WorkerRecord.study_name == study,
        WorkerRecord.host == host,
        WorkerRecord.pid == pid,
        WorkerRecord.ended_at.is_(None),
    )
    stmt = update(WorkerRecord).where(*where).values(**_at_last_beat(), ended_at=WorkerRecord.heartbeat_at)

    def record(s: Session) -> int | None:
        held = s.execute(select(WorkerRecord.current_trial).where(*where)).scalars().first()
        s.execute(stmt)
        return None if held is None else int(held)

    return db.run(record, what="record a dead worker")


@dataclass(frozen=True)
class StaleTrial:
    """A trial whose worker stopped beating without a clean end (killed, host gone, network cut)."""

    worker_id: int
    worker: str
    host: str
    trial_number: int
    heartbeat_at: float
    heartbeat_age_s: float
    device_seconds: float = 0.0
    """The trial's device time up to the last heartbeat, times the worker's devices."""


def stale_trials(
    db: Database,
    study: str,
    *,
    grace_s: float | None = None,
    missed_beats: float = MISSED_BEATS,
    watched_since: float | None = None,
) -> list[StaleTrial]:
    """Trials held by workers whose last heartbeat is older than the grace period.

    The grace period is ``missed_beats`` of the interval each worker recorded (never the
    caller's ``$HPSEARCH_HEARTBEAT_S``: workers may beat slower), or ``grace_s`` where longer.
    ``watched_since`` (database clock) is when the caller's own connection was last known
    healthy: silence counts only from then, since a database that was away kept every beat
    out. Ages are read off the database clock, so hosts with drifting clocks agree.
    """

    def read(s: Session) -> list[StaleTrial]:
        now = float(s.execute(select(db.clock())).scalar_one())
        rows = s.execute(
            select(WorkerRecord).where(
                WorkerRecord.study_name == study,
                WorkerRecord.ended_at.is_(None),
                WorkerRecord.current_trial.is_not(None),
            )
        ).scalars()
        stale = []
        for r in rows:
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
            if r.current_trial is not None and now - since > grace:
                stale.append(_stale(r, now))
        return stale

    return db.run(read, what="find stale trials")


_CLAMPED: set[tuple[int, float]] = set()
"""(row id, grace) pairs this process has warned about in ``stale_trials``."""


def longest_interval(db: Database, study: str) -> float:
    """The longest heartbeat interval the study's unended workers recorded (this process's if none)."""
    longest = db.run(
        lambda s: s.execute(
            select(func.max(WorkerRecord.heartbeat_s)).where(
                WorkerRecord.study_name == study, WorkerRecord.ended_at.is_(None)
            )
        ).scalar_one(),
        what="read the workers' heartbeat intervals",
    )
    return heartbeat_interval() if longest is None else float(longest)


def silent(r: WorkerRecord, now: float, grace_s: float) -> bool:
    """No heartbeat from the row's worker for longer than ``grace_s`` (by the database clock)."""
    return now - r.heartbeat_at > grace_s


def _stale(r: WorkerRecord, now: float) -> StaleTrial:
    assert r.current_trial is not None
    return StaleTrial(
        r.id,
        r.name,
        r.host,
        int(r.current_trial),
        r.heartbeat_at,
        now - r.heartbeat_at,
        max(0.0, r.heartbeat_at - (r.trial_started_at or r.heartbeat_at)) * (1 + r.device.count("+")),
    )


def end_gone(db: Database, study: str, *, host: str, gone: Callable[[int], bool]) -> list[StaleTrial]:
    """End the lost rows of ``host``'s workers whose process is ``gone``; the trials they held.

    A start before this one on the same host was killed with its instance, or stopped while the
    database was away, and could not end its workers' rows. They would show as lost for ever,
    and their trials would wait for a reaper's whole grace of healthy connection: after an
    outage every heartbeat is old, so a reaper cannot tell a dead worker from a silent one. The
    host can. Only stale rows still: a worker elsewhere that shares this host's name (see
    ``this_host``) is not in this host's process table, and a live one beats.
    """

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
                .values(**_at_last_beat(), ended_at=WorkerRecord.heartbeat_at)
            ).rowcount
            if ended == 1 and trial is not None:
                held.append(trial)
        return held

    return db.run(end, what="end the rows of this host's workers that are gone")


def release_stale(db: Database, stale: StaleTrial) -> bool:
    """Take a stale trial off its worker's row; True for exactly one caller.

    The update only matches while the row still shows the heartbeat the caller judged stale,
    so a worker that beat again meanwhile keeps its trial, and of two reapers one wins.
    """
    stmt = (
        update(WorkerRecord)
        .where(
            WorkerRecord.id == stale.worker_id,
            WorkerRecord.current_trial == stale.trial_number,
            WorkerRecord.heartbeat_at == stale.heartbeat_at,
            WorkerRecord.ended_at.is_(None),
        )
        .values(**_at_last_beat())
    )
    return bool(db.run(lambda s: s.execute(stmt).rowcount, what="release a stale trial") == 1)


def _at_last_beat() -> dict[str, Any]:
    """A row's trial taken off it: as far as anyone knows, its device stopped working on the
    trial at the last heartbeat, and that much device time is the worker's."""
    return {
        "device_seconds": device_seconds_at(WorkerRecord.heartbeat_at),
        "current_trial": None,
        "trial_started_at": None,
    }
