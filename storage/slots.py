"""The slot table: a study's ``n_trials`` as numbered slots, each claimed by one worker (on any
host) before it asks for a trial, so the count is exact across hosts."""

from __future__ import annotations

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hpsearch.storage.db import Database
from hpsearch.storage.errors import StorageError
from hpsearch.storage.registry import holding
from hpsearch.storage.tables import TrialSlot, WorkerRecord


def claim_slot(db: Database, study_name: str, n_trials: int, worker: str) -> int | None:
    """Claim a free trial slot; ``None`` once all ``n_trials`` are taken."""
    while True:
        used = db.run(
            lambda s: set(s.scalars(select(TrialSlot.slot).where(TrialSlot.study_name == study_name))),
            what="read trial slots",
        )
        free = next((n for n in range(n_trials) if n not in used), None)
        if free is None:
            return None
        now = db.now()
        try:
            db.run(
                lambda s, slot=free, at=now: s.add(
                    TrialSlot(study_name=study_name, slot=slot, worker=worker, claimed_at=at)
                ),
                what="claim trial slot",
            )
            return free
        except StorageError as exc:
            # Another worker took this slot between our read and our insert: try the next.
            if not isinstance(exc.__cause__, IntegrityError):
                raise


def bind_slot(db: Database, study_name: str, slot: int, trial_number: int) -> None:
    stmt = update(TrialSlot).where(TrialSlot.study_name == study_name, TrialSlot.slot == slot)
    db.run(lambda s: s.execute(stmt.values(trial_number=trial_number)), what="bind trial slot")


def release_slot(db: Database, study_name: str, *, slot: int | None = None, trial_number: int | None = None) -> None:
    """Give a slot back (its trial will be retried, or it was never used)."""
    cond = [TrialSlot.study_name == study_name]
    if slot is not None:
        cond.append(TrialSlot.slot == slot)
    if trial_number is not None:
        cond.append(TrialSlot.trial_number == trial_number)
    db.run(lambda s: s.execute(delete(TrialSlot).where(*cond)), what="release trial slot")


def used_slots(db: Database, study_name: str) -> int:
    count = select(func.count()).select_from(TrialSlot).where(TrialSlot.study_name == study_name)
    return db.run(lambda s: s.execute(count).scalar_one(), what="count trial slots")


def bound_trials(db: Database, study_name: str) -> set[int]:
    """The trial numbers the study's trial slots are bound to."""
    stmt = select(TrialSlot.trial_number).where(TrialSlot.study_name == study_name, TrialSlot.trial_number.is_not(None))
    return {int(n) for n in db.run(lambda s: s.scalars(stmt).all(), what="read bound trial slots")}


def orphaned_slots(db: Database, study_name: str, *, older_than_s: float) -> list[tuple[int, int | None]]:
    """Slots whose worker vanished before the registry knew its trial (claim, ask, bind and record are milliseconds
    apart), as (slot, trial number); an unbound one (``None``) holds a slot for a trial never asked."""

    def read(s: Session) -> list[tuple[int, int | None]]:
        now = s.execute(select(db.clock())).scalar_one()
        held = select(WorkerRecord.current_trial).where(*holding(study_name))
        rows = s.execute(
            select(TrialSlot.slot, TrialSlot.trial_number).where(
                TrialSlot.study_name == study_name,
                TrialSlot.claimed_at < now - older_than_s,
                (TrialSlot.trial_number.is_(None)) | (TrialSlot.trial_number.not_in(held)),
            )
        )
        return [(int(slot), None if number is None else int(number)) for slot, number in rows]

    return db.run(read, what="find orphaned trial slots")


def forget_study(db: Database, study_name: str) -> int:
    """Remove every slot left under ``study_name``, which is being created anew: slots are keyed by name, and deleting
    a study (Optuna's ``delete_study``) leaves ours, so a new study of that name would find its budget used."""
    stmt = delete(TrialSlot).where(TrialSlot.study_name == study_name)
    return int(db.run(lambda s: s.execute(stmt).rowcount, what="remove a deleted study's trial slots"))
