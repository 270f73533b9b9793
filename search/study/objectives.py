"""A study's objectives: the quality objective alone (a single-objective Optuna study), or it and what the model
cost (a two-objective study, whose answer is the Pareto front).

Optuna neither records intermediate values nor prunes in a study of several objectives (``Trial.report`` and
``should_prune`` raise NotImplementedError, optuna#3450), and a pruned trial's intermediate values there break TPE
(it ranks pruned trials by ``study.direction``). So in a two-objective study hpsearch keeps the quality objective's
validation points in a trial attribute (``attrs.POINTS``, which the dashboard shows) and asks the study's own pruner
with a single-objective view of the study (``pruning_view``): the same rules, on the first objective
(docs/search.md, "Cost as a second objective")."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Container, Sequence
from contextlib import suppress
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from hpsearch.storage import attrs

log = logging.getLogger(__name__)


def is_multi(study: optuna.Study) -> bool:
    return len(study.directions) > 1


def quality(trial: FrozenTrial) -> float | None:
    """A finished trial's quality objective (its only value in a single-objective study); None without values."""
    return trial.values[0] if trial.values else None


def cost(trial: FrozenTrial) -> float | None:
    """A complete trial's cost objective in a two-objective study; None in a single-objective one."""
    return trial.values[1] if trial.values and len(trial.values) > 1 else None


def points(trial: FrozenTrial) -> dict[int, float]:
    """The quality objective at each validation point: Optuna's intermediate values, or the trial's
    ``attrs.POINTS`` in a two-objective study (a row: anything unreadable is left out)."""
    if trial.intermediate_values:
        return dict(trial.intermediate_values)
    raw = trial.user_attrs.get(attrs.POINTS)
    found: dict[int, float] = {}
    if isinstance(raw, dict):
        for step, value in raw.items():
            with suppress(TypeError, ValueError):
                found[int(step)] = float(value)
    return found


def cost_of(name: str, device_seconds: float, user_attrs: dict[str, Any]) -> float | None:
    """A trial's cost objective ``name``: device hours from the ledger's figure (``device_seconds``, what
    storage/ledger.py summed), the rest from what the trainer measured (trainer/stats.py ``Figures``); None where
    the trial recorded none."""
    if name == "gpu_hours":
        return device_seconds / 3600
    recorded = user_attrs.get({"trainable_parameters": attrs.TRAINABLE, "peak_memory_gb": attrs.PEAK_MEMORY}[name])
    if not isinstance(recorded, int | float) or isinstance(recorded, bool) or not math.isfinite(recorded):
        return None
    return float(recorded) / 1024 if name == "peak_memory_gb" else float(recorded)


def told(value: float, cost_name: str | None, device_seconds: float, user_attrs: dict[str, Any]) -> list[float] | None:
    """What a complete trial tells the study: its quality, then its cost in a two-objective study; None where the
    cost is not on record."""
    if cost_name is None:
        return [value]
    spent = cost_of(cost_name, device_seconds, user_attrs)
    return None if spent is None else [value, spent]


def front(study: optuna.Study) -> list[FrozenTrial]:
    """A two-objective study's Pareto front, best quality first (ties: the lower cost, the earlier trial); in a
    single-objective study, empty."""
    if not is_multi(study):
        return []
    sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MINIMIZE else -1.0
    return sorted(study.best_trials, key=lambda t: (sign * t.values[0], t.values[1], t.number))


class QualityStorage(BaseStorage):
    """A two-objective study's storage as a single-objective study of its quality objective sees it: one direction,
    each trial's first value, and its ``attrs.POINTS`` as intermediate values. What the pruner is given; every other
    call (the rung attributes successive halving writes among them) goes to the study's storage as it is."""

    def __init__(self, inner: BaseStorage) -> None:
        self._inner = inner

    # -- what the view changes
    def get_study_directions(self, study_id: int) -> list[optuna.study.StudyDirection]:
        return self._inner.get_study_directions(study_id)[:1]

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        return [_single(t) for t in self._inner.get_all_trials(study_id, deepcopy=False, states=states)]

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return _single(self._inner.get_trial(trial_id))

    # -- the rest, as the study's storage has it
    def create_new_study(self, directions: Sequence[optuna.study.StudyDirection], study_name: str | None = None) -> int:
        return self._inner.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        self._inner.delete_study(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._inner.set_study_user_attr(study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._inner.set_study_system_attr(study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._inner.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._inner.get_study_name_from_id(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._inner.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._inner.get_study_system_attrs(study_id)

    def get_all_studies(self) -> list[Any]:  # FrozenStudy: not public in Optuna 5.1
        return self._inner.get_all_studies()

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._inner.create_new_trial(study_id, template_trial)

    def set_trial_param(
        self, trial_id: int, param_name: str, param_value_internal: float, distribution: BaseDistribution
    ) -> None:
        self._inner.set_trial_param(trial_id, param_name, param_value_internal, distribution)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        return self._inner.set_trial_state_values(trial_id, state, values)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._inner.set_trial_intermediate_value(trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._inner.set_trial_user_attr(trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._inner.set_trial_system_attr(trial_id, key, value)


def _single(trial: FrozenTrial) -> FrozenTrial:
    """``trial`` as a single-objective study of its quality objective has it (a copy)."""
    single = copy.copy(trial)
    single.values = trial.values[:1] if trial.values else None
    single.intermediate_values = points(trial)
    return single


def pruning_view(study: optuna.Study, storage: BaseStorage) -> tuple[optuna.Study, QualityStorage]:
    """The study the pruner judges a two-objective study's trials in, its quality objective alone, and its storage
    (``storage``: the study's, which Optuna keeps private)."""
    view = QualityStorage(storage)
    return optuna.Study(study.study_name, view, study.sampler, study.pruner), view
