"""A study's budget: how many trials it may finish and why no new trial may start (its timeout, its device hours
from the ledger, what they cost). The worker asks before each new trial; retries of started trials are not new."""

from __future__ import annotations

import optuna

from hpsearch.search.study.money import Price
from hpsearch.search.study.spec import StudySpec
from hpsearch.storage import attrs, ledger
from hpsearch.storage.open import Storage


def n_trials(study: optuna.Study, spec: StudySpec) -> int:
    return int(study.user_attrs.get(attrs.N_TRIALS, spec.search.n_trials))


def budget_left(storage: Storage, study: optuna.Study, spec: StudySpec, now: float) -> str | None:
    """Why no new trial may start (timeout reached at ``now``, the database clock; device hours used), or None."""
    deadline = study.user_attrs.get(attrs.DEADLINE)
    if deadline is not None and now >= float(deadline):
        return f"timeout of {spec.search.timeout_minutes:g} minutes reached"
    search, price = spec.search, Price.of_search(spec.search)
    if search.gpu_hours <= 0 and (search.budget <= 0 or price is None):
        return None
    used = ledger.device_time(storage.db, study.study_name)
    if search.gpu_hours > 0 and used.seconds >= search.gpu_hours * 3600:
        return f"device time budget used ({used.text(3)} of gpu_hours = {search.gpu_hours:g})"
    if search.budget > 0 and price is not None and price.of(used.seconds) >= search.budget:
        return f"money budget used ({price.text(price.of(used.seconds))} of {price.text(search.budget)})"
    return None
