"""The project's own tables, kept beside Optuna's in the same database."""

from __future__ import annotations

from sqlalchemy import Float, Integer, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    metadata = MetaData()


class TrialSlot(Base):
    """One unit of a study's trial budget, claimed before a trial is asked for: the primary key makes the claim
    atomic on every backend, so ``n_trials`` holds exactly across hosts. Deleted only when its trial is retried."""

    __tablename__ = "hpsearch_budget_slots"  # the name it was created with: existing study databases hold it

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    claimed_at: Mapped[float] = mapped_column(Float)


class WorkerRecord(Base):
    """One worker process of a study, on any host: the registry behind `hpsearch status`. Every time is the
    database clock (Unix seconds), so hosts with drifting clocks agree on which worker is live, finished or lost."""

    __tablename__ = "hpsearch_workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_name: Mapped[str] = mapped_column(String(512), index=True)
    name: Mapped[str] = mapped_column(String(256))
    host: Mapped[str] = mapped_column(String(256))
    device: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    heartbeat_s: Mapped[float] = mapped_column(Float)  # it is lost after missing a few of its own beats
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    current_trial: Mapped[int | None] = mapped_column(Integer, nullable=True)
    trials_finished: Mapped[int] = mapped_column(Integer, default=0)
    # Written by hpsearch before the attempts ledger; kept so that rows can still be added to those databases.
    trial_started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)

    @property
    def devices(self) -> int:
        """How many devices the worker trains each trial on: a device group's label joins them with "+"."""
        return 1 + self.device.count("+")


class Attempt(Base):
    """One attempt of a trial on a worker, stamped by the database clock: the device-time ledger (ledger.py).
    Open (``ended_at`` NULL) while it trains; every device-time figure is a sum over these rows."""

    __tablename__ = "hpsearch_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_name: Mapped[str] = mapped_column(String(512), index=True)
    trial_number: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[int] = mapped_column(Integer, index=True)
    devices: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class StudyCreation(Base):
    """A study hpsearch is creating: written before Optuna's study, removed once its spec is stored. It tells a
    spec-less study of a killed `start` (safe to make again) or of another process creating it right now from one
    made with plain Optuna (refused): Optuna creates a study and its attributes in separate transactions."""

    __tablename__ = "hpsearch_study_creations"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
