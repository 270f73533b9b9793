"""The device-time ledger: an ``Attempt`` row per attempt of a trial, opened when a worker's registry row takes
the trial and closed when it gives the trial up, both by the database clock (hosts' clocks drift). Every
device-time figure (the gpu_hours budget, `status` and its worker rows, the live display, the study note, a
trial's ``device_seconds`` attribute) is a sum of ``attempt_seconds`` over these rows; the study's is
``device_time``, shown by device kind in the one unit each kind has (``unit``: GPU-h, CPU-h)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy
from sqlalchemy import select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import Update
from sqlalchemy.sql.elements import ColumnElement

from hpsearch.storage.db import Database
from hpsearch.storage.tables import Attempt, WorkerRecord


def attempt_seconds(started: float, ended: float, devices: int) -> float:
    """An attempt's device time: its wall time times the devices it held (a "cuda:0+1" group uses two)."""
    return max(0.0, ended - started) * devices


def open_attempt(s: Session, row: WorkerRecord, trial_number: int, clock: float) -> None:
    s.add(
        Attempt(
            study_name=row.study_name,
            trial_number=trial_number,
            worker_id=row.id,
            devices=row.devices,
            started_at=clock,
        )
    )


def close(workers: ColumnElement[bool], at: Any = None) -> Update:
    """Close the open attempts of the worker rows ``workers`` selects, at ``at`` (a time or a SQL expression);
    None: at each worker's last heartbeat, when its device stopped as far as anyone knows (it died or vanished)."""
    if at is None:
        at = select(WorkerRecord.heartbeat_at).where(WorkerRecord.id == Attempt.worker_id).scalar_subquery()
    ids = select(WorkerRecord.id).where(workers)
    return update(Attempt).where(Attempt.worker_id.in_(ids), Attempt.ended_at.is_(None)).values(ended_at=at)


@dataclass(frozen=True)
class Spent:
    trial_number: int
    worker_id: int
    device: str  # the worker's device label: `status` tells GPU time from CPU time by it
    seconds: float


def spent(s: Session, db: Database, study: str, trial: int | None = None) -> list[Spent]:
    """Every attempt of ``study`` (of its trial ``trial``) with its device time: an open one runs until now while
    its worker is live, and until its last heartbeat once the worker is lost."""
    from hpsearch.storage import liveness  # here: liveness closes attempts through this module

    now = float(s.execute(select(db.clock())).scalar_one())
    which = [Attempt.study_name == study] + ([] if trial is None else [Attempt.trial_number == trial])
    rows = s.execute(
        select(Attempt, WorkerRecord).join(WorkerRecord, WorkerRecord.id == Attempt.worker_id).where(*which)
    )
    found = []
    for a, w in rows:
        ended = a.ended_at
        if ended is None:
            ended = w.heartbeat_at if w.ended_at is not None or liveness.is_lost(w, now) else now
        found.append(Spent(a.trial_number, a.worker_id, w.device, attempt_seconds(a.started_at, ended, a.devices)))
    return found


GPU_HOURS, CPU_HOURS = "GPU-h", "CPU-h"


def unit(device: str) -> str:
    """The unit a worker's device time is counted in, by its device label: GPU-h for a CUDA device or group
    ("cuda:0", "cuda:0+1"), CPU-h for the CPU. A study's figures are shown in these units, and only these."""
    return GPU_HOURS if device.startswith("cuda") else CPU_HOURS


@dataclass(frozen=True)
class DeviceTime:
    """Device time by unit (GPU-h, CPU-h): seconds of wall time times the devices held, per ``unit``. The gpu_hours
    budget and the money figures count ``seconds``, every kind together: an hour of a device is an hour of
    budget, whichever the kind; the text says which kinds they were."""

    by_unit: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.by_unit.values())

    def text(self, digits: int = 2) -> str:
        """``0.12 GPU-h``, ``0.12 GPU-h + 0.03 CPU-h``; ``0.00 device-h`` before any attempt opened."""
        shown = [f"{s / 3600:.{digits}f} {u}" for u, s in sorted(self.by_unit.items(), key=lambda x: x[0] != GPU_HOURS)]
        return " + ".join(shown) or f"{0:.{digits}f} device-h"

    @classmethod
    def of(cls, rows: list[Spent]) -> DeviceTime:
        by_unit: dict[str, float] = {}
        for x in rows:
            by_unit[unit(x.device)] = by_unit.get(unit(x.device), 0.0) + x.seconds
        return cls(by_unit)


def device_time(db: Database, study: str) -> DeviceTime:
    """The study's device time so far, running attempts included: the one figure the gpu_hours budget, the money
    budget, the live line, `status` and the study note show. None is on record in a storage an older hpsearch made
    and nothing has opened for a search since (the dashboard's)."""
    if not sqlalchemy.inspect(db.engine).has_table(Attempt.__tablename__):
        return DeviceTime()
    return DeviceTime.of(db.run(lambda s: spent(s, db, study), what="read the device-time ledger"))


def by_trial(db: Database, study: str) -> dict[int, float]:
    """Each trial's device time so far, every attempt of it together (``spent`` summed per trial number)."""
    if not sqlalchemy.inspect(db.engine).has_table(Attempt.__tablename__):
        return {}
    found: dict[int, float] = {}
    for x in db.run(lambda s: spent(s, db, study), what="read the device-time ledger"):
        found[x.trial_number] = found.get(x.trial_number, 0.0) + x.seconds
    return found


def end_trial(db: Database, study: str, number: int, *, ago: float = 0.0) -> float:
    """Close trial ``number``'s open attempt ``ago`` seconds before now (a worker that lost its storage stopped
    counting when the storage last answered); the device time of all the trial's attempts."""

    def end(s: Session) -> float:
        where = (Attempt.study_name == study, Attempt.trial_number == number, Attempt.ended_at.is_(None))
        s.execute(update(Attempt).where(*where).values(ended_at=db.clock() - max(0.0, ago)))
        return sum(x.seconds for x in spent(s, db, study, number))

    return db.run(end, what=f"close trial {number}'s attempt in the device-time ledger")
