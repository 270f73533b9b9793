"""The project's own tables, kept beside Optuna's in the same database."""

from __future__ import annotations

from sqlalchemy import Float, Integer, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    metadata = MetaData()


class BudgetSlot(Base):
    """One unit of a study's trial budget, claimed before a trial is asked for.

    The primary key makes the claim atomic on every backend: two workers that race for the
    last slot cannot both win, so ``n_trials`` is respected exactly across hosts. A slot is
    released (row deleted) only when its trial is handed back for a retry.
    """

    __tablename__ = "hpsearch_budget_slots"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    claimed_at: Mapped[float] = mapped_column(Float)
