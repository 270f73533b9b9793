"""A study's budget: how many trials it may finish and why no new trial may start (its timeout, its device hours
from the ledger). The worker asks before each new trial; retries of started trials are not new."""

from __future__ import annotations

import optuna

from hpsearch.search.spec import StudySpec
from hpsearch.storage import attrs, ledger
from hpsearch.storage.open import Storage


def n_trials(study: optuna.Study, spec: StudySpec) -> int:
    return int(study.user_attrs.get(attrs.N_TRIALS, spec.search.n_trials))


def budget_left(storage: Storage, study: optuna.Study, spec: StudySpec, now: float) -> str | None:
    """Why no new trial may start (timeout reached at ``now``, the database clock; device hours used), or None."""
    deadline = study.user_attrs.get(attrs.DEADLINE)
    if deadline is not None and now >= float(deadline):
        return f"timeout of {spec.search.timeout_minutes:g} minutes reached"
    if spec.search.gpu_hours > 0:
        used = ledger.total(storage.db, study.study_name)
        if used >= spec.search.gpu_hours * 3600:
            return f"device time budget used ({used / 3600:.3f} of {spec.search.gpu_hours:g} GPU hours)"
    return None
