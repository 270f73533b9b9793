"""Handing a trial back: record why it stopped and queue the same parameters again, at most ``max_retries`` times.

Called by outcome.py ``finish`` for every ending its table retries (a stop, a crash, a lost host...)."""

from __future__ import annotations

import logging
from contextlib import suppress
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from hpsearch.storage import attrs, deletions, slots
from hpsearch.storage.open import Storage
from hpsearch.storage.trialdir import BEST, OUT_OF_MEMORY_FILE, RESUME, TrialDir

log = logging.getLogger(__name__)


def hand_back(
    storage: Storage,
    study: optuna.Study,
    trial_id: int,
    *,
    reason: str,
    resume_from: Path | None,
    max_retries: int | None,
    local: bool = True,
) -> bool:
    """Mark the trial failed and, retries permitting, queue it again (before its slot is released, so the next
    worker to claim the slot pops exactly this retry); True if queued. ``local=False``: the resumable state may
    be on another host (the reaper's case), so its path is recorded unchecked, for ``take_over`` to check.
    ``max_retries=None``: a retry that does not count (an out-of-memory restart: see outcome.py)."""
    frozen = storage.optuna.get_trial(trial_id)
    if frozen.state.is_finished():
        return False
    storage.optuna.set_trial_user_attr(trial_id, attrs.FAIL_REASON, reason)
    try:
        storage.optuna.set_trial_state_values(trial_id, TrialState.FAIL)
    except RuntimeError:
        # Finished by someone else in the meantime (e.g. the worker told its result late).
        return False
    count = retries_of(frozen)
    if max_retries is not None and out_of_retries(frozen, max_retries):
        log.warning("trial %d failed (%s); out of retries (%d)", frozen.number, reason, max_retries)
        return False
    resume = resume_from if resume_from is not None and (_resumable(resume_from) or not local) else None
    study.enqueue_trial(
        frozen.params,
        user_attrs={
            attrs.RETRY_OF: frozen.number,
            attrs.RETRY_COUNT: count + 1 if max_retries is not None else count,
            attrs.RESUME_FROM: str(resume) if resume else "",
        },
        skip_if_exists=False,
    )
    slots.release_slot(storage.db, study.study_name, trial_number=frozen.number)
    resuming = f", resuming {resume}" if resume else ""
    which = f"retry {count + 1}/{max_retries}" if max_retries is not None else "a retry (not counted)"
    log.warning("trial %d failed (%s); %s queued%s", frozen.number, reason, which, resuming)
    return True


def retries_of(trial: FrozenTrial) -> int:
    """How many times the trial's parameters were retried before this attempt (0 for a first one)."""
    return int(trial.user_attrs.get(attrs.RETRY_COUNT, 0))


def out_of_retries(trial: FrozenTrial, max_retries: int) -> bool:
    """The one out-of-retries rule: a failed ``trial`` gets no counted retry after ``max_retries`` of them."""
    return retries_of(trial) >= max_retries


def _resumable(state: Path) -> bool:
    """Whether a retry has something to take over: the resumable state, or the out-of-memory record beside it."""
    return state.exists() or state.with_name(OUT_OF_MEMORY_FILE).exists()


def waiting_retries(study: optuna.Study) -> list[int]:
    """The trials whose retry is queued and not yet taken by a worker."""
    return [
        int(t.user_attrs[attrs.RETRY_OF])
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if attrs.RETRY_OF in t.user_attrs
    ]


def pop_retry(storage: BaseStorage, study: optuna.Study) -> optuna.Trial | None:
    """Start a waiting retry of ``study`` (in ``storage``), never a new trial (``Study.ask`` might pop an unstarted
    ``[[search.enqueue]]`` one, or make one): what a worker may still run past the deadline. Optuna's WAITING to
    RUNNING claim has one winner."""
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if attrs.RETRY_OF not in frozen.user_attrs:
            continue
        with suppress(UpdateFinishedTrialError):
            if storage.set_trial_state_values(frozen._trial_id, state=TrialState.RUNNING):
                return optuna.Trial(study, frozen._trial_id)
    return None


def take_over(storage: Storage, study_name: str, trial: optuna.Trial, here: TrialDir) -> Path | None:
    """Move the failed attempt's best model and resumable state into this retry's folder (then the usual clean-up
    covers them, and a crash before this attempt saves its own hands back the same); the state to resume from,
    or None. The source is ``trial-M`` of this host's study folder, M the retried trial: anything else is refused."""
    source, of = trial.user_attrs.get(attrs.RESUME_FROM), trial.user_attrs.get(attrs.RETRY_OF)
    if not source or not isinstance(of, int) or isinstance(of, bool):
        return None
    old = TrialDir(here.root, of)
    if Path(source).resolve() != old.state.resolve():
        msg = "trial %d: refusing resume_from %s: not the resumable state of trial %d in %s; training from the start"
        log.warning(msg, trial.number, source, of, here.root)
        return None
    # An attempt that ran out of memory before its first resumable state left only its record: taken over too.
    left = old.state if old.state.is_file() else old.out_of_memory
    if not left.is_file() or not old.holds(left) or not _failed(storage, study_name, of):
        return None
    if old == here:
        return here.state if here.state.is_file() else None
    # The failed attempt's paths name folders its retry took: marked gone, and why (deletions.py).
    old_id, why = trial_id(storage, study_name, of), f"taken over by its retry, trial {trial.number}"
    # fit() takes the best point from the moved model's own meta (see _restored_best).
    if not here.best.exists() and old.move(BEST, here):
        deletions.mark_deleted(storage.optuna, study_name, old_id, attrs.BEST_CHECKPOINT, why)
    if not old.move(RESUME, here):
        return None
    deletions.mark_deleted(storage.optuna, study_name, old_id, attrs.RESUME_CHECKPOINT, why)
    # fit() loads the state (and records resumed_from_step): reading it here too would load it twice.
    return here.state if here.state.is_file() else None


def trial_id(storage: Storage, study_name: str, number: int) -> int:
    study_id = storage.optuna.get_study_id_from_name(study_name)
    return storage.optuna.get_trial_id_from_study_id_trial_number(study_id, number)


def _failed(storage: Storage, study_name: str, number: int) -> bool:
    """Whether trial ``number`` is a failed attempt: only those hand their folder to a retry."""
    try:
        return storage.optuna.get_trial(trial_id(storage, study_name, number)).state == TrialState.FAIL
    except KeyError:
        return False
