"""The registry's rows as `hpsearch status` shows them: live, finished or lost workers, and the
device time they spent."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from hpsearch.storage import ledger
from hpsearch.storage.db import Database
from hpsearch.storage.liveness import is_lost
from hpsearch.storage.tables import WorkerRecord


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def device_hours(workers: list[WorkerView], *, gpu_only: bool = True) -> float:
    return sum(w.device_seconds for w in workers if w.device.startswith("cuda") or not gpu_only) / 3600.0
