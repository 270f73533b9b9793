"""What the trainer reports, written as trial attributes under storage/attrs.py's keys: ``TrialReporter`` on an Optuna
trial in a search, ``NullReporter`` in memory outside one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpsearch.search.study import objectives
from hpsearch.storage import attrs
from hpsearch.storage.retention import disk_bytes
from hpsearch.trainer.report import measured

if TYPE_CHECKING:
    import optuna
    from optuna.storages import BaseStorage

    from hpsearch.trainer.evaluate import Metrics
    from hpsearch.trainer.stats import Figures


class AttrReporter:
    """The trainer's ``Reporter`` events as attributes, handed to ``set_attrs`` (a subclass's)."""

    immediate = False  # a trial's calls reach a database: they go through the run's report queue

    def set_attrs(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def best_saved(self, path: Path, step: int, values: dict[str, float]) -> None:
        best = {attrs.BEST_VAL + name: value for name, value in values.items()}
        size = round(disk_bytes(path) / 2**20, 2)
        self.set_attrs({attrs.BEST_CHECKPOINT: str(path), attrs.BEST_CHECKPOINT_MB: size, attrs.BEST_STEP: step} | best)

    def state_saved(self, path: Path) -> None:
        self.set_attrs({attrs.RESUME_CHECKPOINT: str(path)})

    def resumed(self, step: int) -> None:
        self.set_attrs({attrs.RESUMED_FROM_STEP: step})

    def measured(self, figures: Figures) -> None:
        self.set_attrs(measured(figures))  # each under its field name (storage/attrs.py says so)


class NullReporter(AttrReporter):
    """Runs a fine-tune outside any search: records values and attributes as a trial would, never prunes."""

    immediate = True  # called directly, not through a report queue: its calls never wait (see StateSavingReporter)

    def __init__(self) -> None:
        self.values: dict[int, float] = {}
        self.attrs: dict[str, Any] = {}

    def report(self, value: float, step: int, metrics: Metrics | None = None) -> None:
        self.values[step] = value

    def should_prune(self) -> bool:
        return False

    def set_attrs(self, values: dict[str, Any]) -> None:
        self.attrs.update(values)


class TrialReporter(AttrReporter):
    """The trainer's Reporter, backed by an Optuna trial. In a two-objective study, where Optuna neither records
    nor prunes, the points go to ``attrs.POINTS`` and the pruner judges them in a single-objective view
    (search/study/objectives.py)."""

    def __init__(self, trial: optuna.Trial, storage: BaseStorage) -> None:
        """``storage``: the trial's study's (the pruner of a two-objective study reads it through a view)."""
        self.trial = trial
        self.judge = objectives.pruning_view(trial.study, storage) if objectives.is_multi(trial.study) else None
        self.points: dict[str, float] = {}
        # When a call last reached the storage: a storage-failed attempt's device time counts up to here.
        self.last_ok = time.monotonic()

    def report(self, value: float, step: int, metrics: object = None) -> None:
        if self.judge is None:
            self.trial.report(value, step)
        elif str(step) not in self.points:  # Optuna's rule: a step's first report stands
            self.points[str(step)] = float(value)
            self.trial.set_user_attr(attrs.POINTS, self.points)
        self.last_ok = time.monotonic()

    def should_prune(self) -> bool:
        if self.judge is None:
            prune = self.trial.should_prune()
        else:
            # Read back, as Optuna's should_prune does: the pruner sees what the storage holds.
            study, view = self.judge
            prune = study.pruner.prune(study, view.get_trial(self.trial._trial_id))
        self.last_ok = time.monotonic()
        return prune

    def set_attrs(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self.trial.set_user_attr(key, value)
        self.last_ok = time.monotonic()
