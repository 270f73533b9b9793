"""Warm start (``[search] warm_start``): a new study begins from what an earlier one learned.

`start` reads the earlier study (read only) before anything is written, and ``plan`` turns its finished trials into
this study's terms; ``apply`` writes the plan once, as the study is created (search/study.py ``_create``, under the
study's creation lock, so neither a resume nor a second worker applies it again). The earlier study's rows are input,
not instruction: every value is checked against this study's space (type, range, choices, grid) and every set
against [train]'s rules before it is queued or shown to a sampler. What each sampler does with it: docs/search.md,
"Warm start"."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.errors import SpecError
from hpsearch.search.sampling import distribution
from hpsearch.search.search_config import check_warm_start
from hpsearch.search.space import ADAPTER_PREFIX
from hpsearch.search.spec import StudySpec
from hpsearch.storage import attrs, urls
from hpsearch.storage.errors import StorageUrlError, StudyNotFoundError
from hpsearch.storage.open import open_storage

log = logging.getLogger(__name__)
WHERE = "search.warm_start"
MAX_QUEUED = 5
"""At most this many of the earlier study's best configurations run first (and at most a third of n_trials): the
rest of the budget is the sampler's, which has their results too."""
LEARNS_FROM_RESULTS = ("tpe", "gp")
"""Samplers that model earlier results. qmc, random and grid would ignore them (and cmaes keeps its own state):
for those the queued configurations are the whole warm start."""


@dataclass
class Plan:
    """What a warm start writes into the new study: configurations to run first and results for the sampler."""

    source: str  # "STUDY" or "URL#STUDY" (password masked): where each copied row says it came from
    finished: int  # the earlier study's finished trials with a finite value
    queue: list[tuple[dict[str, Any], int]] = field(default_factory=list)  # (params, earlier trial number), best first
    results: list[tuple[dict[str, Any], float, int]] = field(default_factory=list)  # (params, value, number)
    lines: list[str] = field(default_factory=list)  # what was left out, one line each: said once it is applied


def plan(spec: StudySpec, name: str, url: str) -> Plan | None:
    """Read the study ``spec.search.warm_start`` names and fit its finished trials to ``spec``'s space; None without
    a warm start. Bad input raises SpecError (or StudyNotFoundError, naming the studies there): exit 2, nothing
    written."""
    if not spec.search.warm_start:
        return None
    other, source_name = check_warm_start(spec.search.warm_start, WHERE)
    source_url = urls.normalize(urls.resolve(other) if other is not None else url)
    if source_name == name and source_url == urls.normalize(url):
        raise SpecError(f"{WHERE}: {spec.search.warm_start!r} is this study itself; name an earlier study")
    label = source_name if other is None else f"{urls.mask(other)}#{source_name}"
    try:
        storage = open_storage(source_url, create=False, read_only=True)
    except (StorageUrlError, StudyNotFoundError) as exc:
        raise SpecError(f"{WHERE}: {exc}") from None
    with closing(storage):
        try:
            study_id = storage.optuna.get_study_id_from_name(source_name)
        except KeyError:
            names = ", ".join(s.study_name for s in storage.optuna.get_all_studies()) or "none"
            raise StudyNotFoundError(
                f"{WHERE}: study {source_name!r} does not exist in {storage.display} (studies there: {names}); "
                "name one of them"
            ) from None
        _check_objective(spec, label, optuna.load_study(study_name=source_name, storage=storage.optuna))
        # What it ran itself: results it was given by a warm start of its own are not its configurations.
        trials = ran_here(storage.optuna.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,)))
        fixed = _fixed_values(storage.optuna.get_study_user_attrs(study_id).get(attrs.SPEC))
    return fit(spec, label, trials, fixed)


def _check_objective(spec: StudySpec, label: str, earlier: optuna.Study) -> None:
    """The earlier study's quality objective must mean what this one's does: same direction, same metric where it
    names one (either study may have a cost objective beside it: only the quality objective is read)."""
    direction = earlier.directions[0].name.lower()
    if direction != spec.direction:
        raise SpecError(
            f"{WHERE}: study {label} has direction {direction}, this one {spec.direction} "
            f"(metric {spec.search.quality!r}); start from a study with the same metric"
        )
    names = earlier.metric_names
    if names is not None and names[0] != spec.metric_names[0]:
        raise SpecError(
            f"{WHERE}: study {label} scored {names[0]}, this one scores {spec.metric_names[0]}; its values "
            "would mislead the sampler: start from a study with the same metric"
        )


def _fixed_values(stored: Any) -> dict[str, Any]:
    """What every trial of the earlier study trained with where it searched nothing, by parameter name: its stored
    spec's [train] and [adapter] values (an untrusted row: each one is checked like any other value)."""
    if not isinstance(stored, dict):
        return {}
    train, adapter = stored.get("train"), stored.get("adapter")
    values = dict(train) if isinstance(train, dict) else {}
    if isinstance(adapter, dict):
        values.update({ADAPTER_PREFIX + k: v for k, v in adapter.items()})
    return values


def fit(spec: StudySpec, label: str, trials: Iterable[FrozenTrial], fixed: dict[str, Any]) -> Plan:
    """The earlier trials in this study's terms, best first. A parameter this space does not search is left out;
    one it searches that the earlier trial did not takes the value the earlier study trained with (``fixed``); a
    value outside this space is left out of that trial. A trial missing any parameter is still queued (the sampler
    proposes what is missing) but not given to the sampler, which needs whole points."""
    sign = 1 if spec.direction == "minimize" else -1
    finished = sorted((t for t in trials if math.isfinite(_quality(t))), key=lambda t: (sign * _quality(t), t.number))
    out = Plan(label, len(finished))
    left_out: dict[str, list[str]] = {}
    for name in sorted({k for t in finished for k in t.params} - set(spec.space)):
        left_out[name] = [f"not a parameter of this study's [search.space] ({len(spec.space)} searched)"]
    seen: set[tuple[tuple[str, str], ...]] = set()
    n_queue = min(MAX_QUEUED, max(1, spec.search.n_trials // 3))
    for trial in finished:
        params = _params(spec, trial, fixed, left_out)
        try:
            spec.check_trial(params, f"trial {trial.number} of {label}")
        except SpecError as exc:
            out.lines.append(f"warm start: left out {exc}")
            continue
        key = tuple(sorted((k, repr(v)) for k, v in params.items()))
        if params and key not in seen and len(out.queue) < n_queue:
            seen.add(key)
            out.queue.append((params, trial.number))
        # A two-objective study is given no results: a point on its front needs a cost the earlier run did not pay.
        if set(params) == set(spec.space) and spec.search.sampler in LEARNS_FROM_RESULTS and not spec.search.cost:
            out.results.append((params, _quality(trial), trial.number))
    for name, reasons in left_out.items():
        more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
        out.lines.append(f"warm start: parameter {name} of {label} left out: {reasons[0]}{more}")
    return out


def _quality(trial: FrozenTrial) -> float:
    """The trial's quality objective (the first, in a one- or two-objective study); nan where it has none."""
    return trial.values[0] if trial.values else math.nan


def _params(
    spec: StudySpec, trial: FrozenTrial, fixed: dict[str, Any], left_out: dict[str, list[str]]
) -> dict[str, Any]:
    """``trial``'s values for this space, each checked; a value that does not fit is noted in ``left_out``."""
    params: dict[str, Any] = {}
    for name, param in spec.space.items():
        if name in trial.params:
            value, where = trial.params[name], f"trial {trial.number}'s value"
        elif name in fixed:
            value, where = fixed[name], "its fixed [train] value"
        else:
            continue
        try:
            params[name] = param.check_value(value, where)
        except SpecError as exc:
            left_out.setdefault(name, []).append(str(exc))
    return params


def apply(study: optuna.Study, spec: StudySpec, warm: Plan) -> None:
    """Queue the plan's configurations and copy its results into the new ``study`` (search/study.py ``_create``
    calls this once, under the creation lock), then record that it was applied."""
    for line in warm.lines:
        log.info("%s", line)
    for params, number in warm.queue:
        study.enqueue_trial(params, user_attrs={attrs.ENQUEUED: True, attrs.WARM_START_OF: f"{warm.source}#{number}"})
    space = {name: distribution(p) for name, p in spec.space.items()}
    study.add_trials(
        optuna.trial.create_trial(
            params=params,
            distributions=space,
            value=value,
            user_attrs={attrs.EARLIER_RESULT: f"{warm.source}#{number}"},
        )
        for params, value, number in warm.results
    )
    record = {"from": warm.source, "finished": warm.finished, "queued": len(warm.queue), "results": len(warm.results)}
    study.set_user_attr(attrs.WARM_START, record)
    given = f", {len(warm.results)} results given to the {spec.search.sampler} sampler" if warm.results else ""
    log.info(
        "warm start from %s: %d finished trials, the best %d queued first%s",
        warm.source,
        warm.finished,
        len(warm.queue),
        given,
    )


def ran_here(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """``trials`` without the earlier results a warm start copied in: what this study itself ran."""
    return [t for t in trials if attrs.EARLIER_RESULT not in t.user_attrs]
