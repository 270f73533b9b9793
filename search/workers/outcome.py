"""How an attempt ends: one table (``ENDINGS``), and one ``finish`` that the worker, the supervisor and the reaper call.

Like rq's single ``handle_job_failure``: whoever sees an attempt end names its ``Outcome``; the table decides
the Optuna state, the retry, what stays of ``best/`` and ``resume/`` and the ``fail_reason``; the attempt's
device time comes from the ledger (storage/ledger.py)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.study import objectives
from hpsearch.search.workers import retry
from hpsearch.storage import attrs, deletions, ledger
from hpsearch.storage.open import Storage
from hpsearch.storage.trialdir import TrialDir
from hpsearch.trainer.report import FailReason

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    COMPLETE = enum.auto()
    PRUNED = enum.auto()
    FAILED = enum.auto()  # an error of the trial (or no validation point reached): not retried
    INTERRUPTED = enum.auto()  # a stop request: the worker saved its resumable state
    STORAGE_LOST = enum.auto()  # the storage failed during the trial: not the trial's fault
    CRASHED = enum.auto()  # the worker process died; its supervisor saw it
    LOST = enum.auto()  # the worker vanished (host gone, network cut); a reaper saw its heartbeat go stale
    NOT_STARTED = enum.auto()  # the worker could not register the trial it was given
    OUT_OF_MEMORY = enum.auto()  # a rank of a device group ran out of memory: the group restarts smaller


class Files(enum.Enum):
    KEEP = "keep"
    DELETE = "delete"


class Resume(enum.Enum):
    """Where a retry resumes from."""

    NOTHING = "nothing"
    HERE = "here"  # the trial folder's resumable state on this host, if it is there
    RECORDED = "recorded"  # the path the trial recorded at its start (resume_checkpoint): maybe on another host


@dataclass(frozen=True)
class Ending:
    state: TrialState
    retried: bool
    best: Files
    resume: Files
    resumes_from: Resume
    reason: FailReason | None  # the fail_reason; None: the caller's (a pruned or failed trial says why)
    # Whether the retry counts against max_retries: not an out-of-memory restart, which halves the micro-batch
    # each time (micro-batch 1 ends the trial), as one device halves it in place without a retry.
    counted: bool = True


_FAIL, _KEEP, _DELETE = TrialState.FAIL, Files.KEEP, Files.DELETE
ENDINGS: dict[Outcome, Ending] = {
    # Only complete trials compete for a kept best/ (retention); only a retry resumes from resume/.
    #                   Optuna state         retried  best/    resume/  the retry resumes from
    Outcome.COMPLETE: Ending(TrialState.COMPLETE, False, _KEEP, _DELETE, Resume.NOTHING, None),
    Outcome.PRUNED: Ending(TrialState.PRUNED, False, _DELETE, _DELETE, Resume.NOTHING, None),
    Outcome.FAILED: Ending(_FAIL, False, _DELETE, _DELETE, Resume.NOTHING, None),
    Outcome.INTERRUPTED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, FailReason.INTERRUPTED),
    Outcome.STORAGE_LOST: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, FailReason.STORAGE_ERROR),
    Outcome.CRASHED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, FailReason.WORKER_CRASH),
    Outcome.LOST: Ending(_FAIL, True, _KEEP, _KEEP, Resume.RECORDED, FailReason.WORKER_LOST),
    Outcome.NOT_STARTED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.NOTHING, FailReason.NOT_STARTED),
    Outcome.OUT_OF_MEMORY: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, FailReason.OOM_RESTART, counted=False),
}


def finish(
    storage: Storage,
    study: optuna.Study,
    trial_id: int,
    outcome: Outcome,
    *,
    max_retries: int,
    folder: TrialDir | None = None,
    reason: FailReason | None = None,
    detail: str | None = None,
    value: float | None = None,
    cost: str | None = None,
    ago: float = 0.0,
) -> bool | None:
    """End a running trial's attempt as ``ENDINGS`` says; whether a retry was queued, None if it was not running
    (finished meanwhile by a reaper, or by the worker telling its result late: left alone).

    ``folder``: the trial's folder on this host (None: none to touch); ``reason`` and ``detail``: why it was
    pruned or failed (the table names the reason of every other ending); ``value`` and ``cost``: a complete trial's
    quality objective, and the name of a two-objective study's cost objective (search/study/objectives.py, read off the
    trial here); ``ago``: the attempt stopped that many seconds ago (a worker whose storage went away stopped
    counting when it last answered)."""
    ending = ENDINGS[outcome]
    frozen = storage.optuna.get_trial(trial_id)
    if frozen.state != TrialState.RUNNING:
        log.info("trial %d is %s already; leaving it as it is", frozen.number, frozen.state.name.lower())
        return None
    # A copy of the ledger's figure for the dashboard, before the trial is told: a finished trial takes no attributes.
    seconds = ledger.end_trial(storage.db, study.study_name, frozen.number, ago=ago)
    storage.optuna.set_trial_user_attr(trial_id, attrs.DEVICE_SECONDS, round(seconds, 3))
    if folder is not None:
        # Read now, not before: the trainer's last attributes may have been on their way.
        trial, gone = storage.optuna.get_trial(trial_id), f"trial {outcome.name.lower()}"
        clear(storage.optuna, study.study_name, trial, folder, ending, gone)
    why = ending.reason or reason
    recorded = why.record(detail)[:500] if why else None
    if ending.retried:
        state = frozen.user_attrs.get(attrs.RESUME_CHECKPOINT)
        resume = {
            Resume.NOTHING: None,
            Resume.HERE: folder.state if folder else None,
            Resume.RECORDED: Path(state) if state else None,
        }[ending.resumes_from]
        local = ending.resumes_from is not Resume.RECORDED  # the reaper's may be on another host: take_over checks
        assert recorded is not None
        retries = max_retries if ending.counted else None
        return retry.hand_back(
            storage, study, trial_id, reason=recorded, resume_from=resume, max_retries=retries, local=local
        )
    state, values = ending.state, None
    if state == TrialState.COMPLETE and value is not None:
        # The trainer's figures are read only where a cost needs them: a single-objective study tells its value.
        figures = storage.optuna.get_trial(trial_id).user_attrs if cost else {}
        values = objectives.told(value, cost, seconds, figures)
        if values is None:  # the trainer's figures never arrived: a result without its cost is no point on the front
            state, recorded = TrialState.FAIL, FailReason.ERROR.record(f"no {cost} on record for the cost objective")
    if recorded is not None:
        storage.optuna.set_trial_user_attr(trial_id, attrs.FAIL_REASON, recorded)
    _tell(storage, study, trial_id, frozen.number, values, state)
    return False


def ending_of(trial: FrozenTrial) -> Ending:
    """A finished trial's row of the table, read back from its state and recorded reason (the leftover sweep's)."""
    if trial.state != TrialState.FAIL:
        return ENDINGS[Outcome.COMPLETE if trial.state == TrialState.COMPLETE else Outcome.PRUNED]
    why = FailReason.of(trial.user_attrs.get(attrs.FAIL_REASON))
    return next((e for e in ENDINGS.values() if e.retried and e.reason is why), ENDINGS[Outcome.FAILED])


def clear(
    storage: RDBStorage,
    study: str,
    trial: FrozenTrial,
    folder: TrialDir,
    ending: Ending,
    why: str,
    *,
    released: bool = False,
) -> list[Path]:
    """Remove what the table says goes of the trial folder's best/ and resume/, and with ``released`` (no retry
    will take them over) what a retried ending kept; what went. The trial's ``best_checkpoint`` or
    ``resume_checkpoint`` that named a removed folder is marked deleted for ``why``."""
    gone = []
    for path, files, key in (
        (folder.best, ending.best, attrs.BEST_CHECKPOINT),
        (folder.resume, ending.resume, attrs.RESUME_CHECKPOINT),
    ):
        if not (files is Files.DELETE or (released and ending.retried)):
            continue
        removed = folder.remove(path)
        gone += [path] if removed else []
        # As the attempt ends (its trial still running), the path it recorded is marked even where nothing was saved
        # there yet: it is no state to load any more. The sweep marks only what it removed.
        if removed or trial.state == TrialState.RUNNING:
            deletions.mark_deleted(storage, study, trial._trial_id, key, why)
    return gone


def _tell(
    storage: Storage, study: optuna.Study, trial_id: int, number: int, values: list[float] | None, state: TrialState
) -> None:
    """``study.tell``, taking the grid's end for what it is: once every point has run, GridSampler calls
    ``study.stop()`` (RuntimeError outside ``optimize``); with one left, it reads the grid index a retry or an
    enqueued trial lacks (KeyError). tell stores the trial all the same: neither is a failure, nor "reaped"."""
    try:
        study.tell(number, values, state=state)
    except (RuntimeError, KeyError):
        if not isinstance(study.sampler, optuna.samplers.GridSampler):
            raise
        if storage.optuna.get_trial(trial_id).state != state:
            raise
        # The budget, not the sampler, ends the search: a failed point's retry may wait.
        log.info("trial %d was the last point of the grid", number)
