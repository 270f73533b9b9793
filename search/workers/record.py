"""One trial's record in its study, as the worker running an attempt writes it: its start (its slot, the worker's
registry row and the device-time ledger's open), what the trainer reports (through ``reporter``,
workers/trial_attrs.py), where it runs, the takeover of a failed attempt's folder, and the attempt's end
(outcome.py's table: its state, fail_reason, retry and the ledger's close). The deletion of its
checkpoints is storage/deletions.py's, which retention (storage/, below search/) writes too."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import optuna

from hpsearch.search.workers import outcome, retry
from hpsearch.search.workers.outcome import Outcome
from hpsearch.search.workers.trial_attrs import TrialReporter
from hpsearch.storage import registry, slots
from hpsearch.storage.errors import StorageError
from hpsearch.storage.open import Storage
from hpsearch.storage.trialdir import TrialDir

log = logging.getLogger(__name__)


class TrialRecord:
    """The record of ``trial`` of ``study`` (in ``storage``); ``max_retries`` and ``cost`` are the study spec's."""

    def __init__(
        self, storage: Storage, study: optuna.Study, trial: optuna.Trial, *, max_retries: int, cost: str | None
    ) -> None:
        self.storage, self.study, self.trial = storage, study, trial
        self.max_retries, self.cost = max_retries, cost

    @property
    def number(self) -> int:
        return self.trial.number

    def begin(self, slot: int, registration: registry.Registration | None) -> None:
        """Bind the trial to its slot and to this worker's registry row, which opens its attempt in the device-time
        ledger (one transaction). Until the row names the trial, no heartbeat covers it: a failure in between hands
        it back here."""
        try:
            slots.bind_slot(self.storage.db, self.study.study_name, slot, self.number)
            if registration:
                registration.trial_started(self.number)
        except BaseException:
            log.error("trial %d could not be registered; handing it back", self.number)
            try:
                self.end(Outcome.NOT_STARTED)
            except StorageError as err:
                # Left RUNNING: the next worker to start finds it orphaned, fails and retries it (reap.py).
                log.warning("could not hand trial %d back: %s", self.number, err)
            raise

    def leave(self, registration: registry.Registration | None, *, finished: bool) -> None:
        """The worker's row lets go of the trial (``finished``: it ended here; else handed back), closing its
        attempt in the ledger if its end did not."""
        if registration:
            registration.trial_ended(finished=finished)

    @functools.cached_property
    def reporter(self) -> TrialReporter:
        """What the trainer's reports become: the trial's points and attributes (one per record)."""
        return TrialReporter(self.trial, self.storage.optuna)

    def set_attrs(self, values: dict[str, Any]) -> None:
        self.reporter.set_attrs(values)

    def take_over(self, folder: TrialDir) -> Path | None:
        """A retry's: move the failed attempt's best model and resumable state into ``folder``; the state to resume
        from, or None (retry.py ``take_over``, which marks the failed attempt's paths deleted)."""
        return retry.take_over(self.storage, self.study.study_name, self.trial, folder)

    def end(self, ended: Outcome, **how: Any) -> bool | None:
        """End this attempt as outcome.py's table says (``how``: ``finish``'s keywords); whether a retry was queued,
        None if someone else ended it meanwhile."""
        done = outcome.finish(
            self.storage,
            self.study,
            self.trial._trial_id,
            ended,
            max_retries=self.max_retries,
            cost=self.cost,
            **how,
        )
        if done is None:
            # Our heartbeat went stale (a long network cut): a reaper failed the trial, and its retry owns it now.
            log.warning("trial %d was reaped while it ran here; dropping this attempt", self.number)
        return done
