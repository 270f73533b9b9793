"""How an attempt ends: one table (``ENDINGS``), and one ``finish`` that the worker, the supervisor and the reaper call.

Like rq's single ``handle_job_failure``: whoever sees an attempt end names its ``Outcome``; the table decides
the Optuna state, the retry, what stays of ``best/`` and ``resume/``, the ``fail_reason`` and the device time."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from hpsearch.search import retry
from hpsearch.storage import attrs, checkpoints as retention
from hpsearch.storage.open import Storage
from hpsearch.storage.trialdir import TrialDir

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    COMPLETE = "complete"
    PRUNED = "pruned"
    FAILED = "failed"  # an error of the trial (or no validation point reached): not retried
    INTERRUPTED = "interrupted"  # a stop request: the worker saved its resumable state
    STORAGE_LOST = "storage_lost"  # the storage failed during the trial: not the trial's fault
    CRASHED = "crashed"  # the worker process died; its supervisor saw it
    LOST = "lost"  # the worker vanished (host gone, network cut); a reaper saw its heartbeat go stale
    NOT_STARTED = "not_started"  # the worker could not register the trial it was given


class Files(enum.Enum):
    KEEP = "keep"
    DELETE = "delete"


class Resume(enum.Enum):
    """Where a retry resumes from."""

    NOTHING = "nothing"
    HERE = "here"  # the trial folder's resumable state on this host, if it is there
    RECORDED = "recorded"  # the path the trial recorded at its start (resume_checkpoint): maybe on another host


class DeviceTime(enum.Enum):
    MEASURED = "measured"  # the attempt measured its own: added to what the trial has
    ESTIMATED = "estimated"  # by whoever saw it end: written only if the attempt recorded none


@dataclass(frozen=True)
class Ending:
    state: TrialState
    retried: bool
    best: Files
    resume: Files
    resumes_from: Resume
    reason: str | None  # the fail_reason; "{}" stands for the caller's detail
    device_time: DeviceTime


_FAIL, _KEEP, _DELETE = TrialState.FAIL, Files.KEEP, Files.DELETE
ENDINGS: dict[Outcome, Ending] = {
    # Only complete trials compete for a kept best/ (retention); only a retry resumes from resume/.
    #                   Optuna state         retried  best/    resume/  the retry resumes from
    Outcome.COMPLETE: Ending(TrialState.COMPLETE, False, _KEEP, _DELETE, Resume.NOTHING, None, DeviceTime.MEASURED),
    Outcome.PRUNED: Ending(TrialState.PRUNED, False, _DELETE, _DELETE, Resume.NOTHING, "{}", DeviceTime.MEASURED),
    Outcome.FAILED: Ending(_FAIL, False, _DELETE, _DELETE, Resume.NOTHING, "{}", DeviceTime.MEASURED),
    Outcome.INTERRUPTED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, "interrupted", DeviceTime.MEASURED),
    Outcome.STORAGE_LOST: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, "storage_error ({})", DeviceTime.MEASURED),
    Outcome.CRASHED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.HERE, "worker_crash ({})", DeviceTime.ESTIMATED),
    Outcome.LOST: Ending(_FAIL, True, _KEEP, _KEEP, Resume.RECORDED, "worker_lost", DeviceTime.ESTIMATED),
    Outcome.NOT_STARTED: Ending(_FAIL, True, _KEEP, _KEEP, Resume.NOTHING, "not_started", DeviceTime.ESTIMATED),
}


def device_seconds(since: float, until: float, devices: int) -> float:
    """An attempt's device time: its wall time (by one clock) times the devices it held."""
    return max(0.0, until - since) * devices


def finish(
    storage: Storage,
    study: optuna.Study,
    trial_id: int,
    outcome: Outcome,
    *,
    max_retries: int,
    folder: TrialDir | None = None,
    detail: str | None = None,
    value: float | None = None,
    spent: float | None = None,
) -> bool | None:
    """End a running trial's attempt as ``ENDINGS`` says; whether a retry was queued, None if it was not running
    (finished meanwhile by a reaper, or by the worker telling its result late: left alone).

    ``folder``: the trial's folder on this host (None: none to touch); ``spent``: this attempt's device time."""
    ending = ENDINGS[outcome]
    frozen = storage.optuna.get_trial(trial_id)
    if frozen.state != TrialState.RUNNING:
        log.info("trial %d is %s already; leaving it as it is", frozen.number, frozen.state.name.lower())
        return None
    measured = ending.device_time is DeviceTime.MEASURED
    if spent is not None and (measured or attrs.DEVICE_SECONDS not in frozen.user_attrs):
        # Recorded before the trial is told: a finished trial takes no more attributes.
        before = float(frozen.user_attrs.get(attrs.DEVICE_SECONDS, 0.0)) if measured else 0
        storage.optuna.set_trial_user_attr(trial_id, attrs.DEVICE_SECONDS, round(before + spent, 3))
    if folder is not None:
        _clear(storage, trial_id, folder, ending, outcome)
    reason = ending.reason.format(detail)[:500] if ending.reason and (detail or "{}" not in ending.reason) else None
    if ending.retried:
        recorded = frozen.user_attrs.get(attrs.RESUME_CHECKPOINT)
        resume = {
            Resume.NOTHING: None,
            Resume.HERE: folder.state if folder else None,
            Resume.RECORDED: Path(recorded) if recorded else None,
        }[ending.resumes_from]
        local = ending.resumes_from is not Resume.RECORDED  # the reaper's may be on another host: take_over checks
        assert reason is not None
        return retry.hand_back(
            storage, study, trial_id, reason=reason, resume_from=resume, max_retries=max_retries, local=local
        )
    if reason is not None:
        storage.optuna.set_trial_user_attr(trial_id, attrs.FAIL_REASON, reason)
    _tell(storage, study, trial_id, frozen.number, value if ending.state == TrialState.COMPLETE else None, ending.state)
    return False


def _clear(storage: Storage, trial_id: int, folder: TrialDir, ending: Ending, outcome: Outcome) -> None:
    if ending.best is Files.DELETE:
        folder.remove(folder.best)
        # Read now, not before: the trainer's last attributes may have been on their way.
        if storage.optuna.get_trial(trial_id).user_attrs.get(attrs.BEST_CHECKPOINT):
            note = retention.deleted_note(f"trial {outcome.value}")
            storage.optuna.set_trial_user_attr(trial_id, attrs.BEST_CHECKPOINT, note)
    if ending.resume is Files.DELETE:
        folder.remove(folder.resume)


def _tell(
    storage: Storage, study: optuna.Study, trial_id: int, number: int, value: float | None, state: TrialState
) -> None:
    """``study.tell``, taking the grid's end for what it is: once every point has run, GridSampler calls
    ``study.stop()`` (RuntimeError outside ``optimize``); with one left, it reads the grid index a retry or an
    enqueued trial lacks (KeyError). tell stores the trial all the same: neither is a failure, nor "reaped"."""
    try:
        study.tell(number, value, state=state)
    except (RuntimeError, KeyError):
        if not isinstance(study.sampler, optuna.samplers.GridSampler):
            raise
        if storage.optuna.get_trial(trial_id).state != state:
            raise
        # The budget, not the sampler, ends the search: a failed point's retry may wait.
        log.info("trial %d was the last point of the grid", number)
