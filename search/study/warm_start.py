"""Warm start (``[search] warm_start``): a new study begins from what an earlier one learned.

`start` reads the earlier study (read only) before anything is written, and ``plan`` turns its finished trials into
this study's terms; ``apply`` writes the plan once, as the study is created (study/studies.py ``_create``, under the
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
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.errors import SpecError
from hpsearch.search.study.sampling import distribution
from hpsearch.search.study.search_config import check_warm_start
from hpsearch.search.study.space import ADAPTER_PREFIX
from hpsearch.search.study.spec import StudySpec
from hpsearch.storage import attrs, urls
from hpsearch.storage.errors import StorageUrlError, StudyNotFoundError
from hpsearch.storage.open import Storage, damaged, damaged_message, open_storage
from hpsearch.storage.shown import shown

log = logging.getLogger(__name__)
WHERE = "search.warm_start"
LINE = 600
"""Characters of one line about the earlier study: its parts are each cut and escaped already, this bounds their sum."""
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
    label = shown(source_name) if other is None else f"{urls.mask(other)}#{shown(source_name)}"
    try:
        storage = open_storage(source_url, create=False, read_only=True)
    except (StorageUrlError, StudyNotFoundError) as exc:
        raise SpecError(f"{WHERE}: {exc}") from None
    with closing(storage):
        try:
            return _read(spec, storage, source_name, label)
        except (SpecError, StudyNotFoundError):
            raise  # already one line (whose text, holding names from the rows, is not SQLite's to judge)
        except UNREADABLE as exc:  # a row Optuna's own reader fails on: written by hand, not by Optuna
            raise SpecError(f"{WHERE}: study {label} cannot be read ({_why(exc)}); start from another study") from None
        except Exception as exc:
            if said := damaged(exc):  # the earlier study's file, not this study's --storage
                raise SpecError(f"{WHERE}: {damaged_message(storage.display, said)}") from None
            raise


UNREADABLE = (ValueError, TypeError, LookupError, ArithmeticError)
"""What Optuna's reader raises on a row it did not write (text where a number goes, JSON that is not, an enum value
it does not know): the earlier study is another program's input, never a traceback here."""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shown(exc)}"


def _read(spec: StudySpec, storage: Storage, source_name: str, label: str) -> Plan:
    try:
        study_id = storage.optuna.get_study_id_from_name(source_name)
    except KeyError:
        names = [s.study_name for s in storage.optuna.get_all_studies()]
        listed = ", ".join(shown(n) for n in names[:MAX_LISTED]) + (" ..." if len(names) > MAX_LISTED else "")
        raise StudyNotFoundError(
            f"{WHERE}: study '{shown(source_name)}' does not exist in {storage.display} (studies there: "
            f"{listed or 'none'}); name one of them"
        ) from None
    _check_objective(spec, label, optuna.load_study(study_name=source_name, storage=storage.optuna))
    lines: list[str] = []
    # What it ran itself: results it was given by a warm start of its own are not its configurations.
    trials = ran_here(_finished_trials(storage, study_id, label, lines))
    try:
        fixed = _fixed_values(storage.optuna.get_study_user_attrs(study_id).get(attrs.SPEC))
    except UNREADABLE as exc:
        lines.append(f"warm start: the stored spec of {label} is left out: it cannot be read ({_why(exc)})")
        fixed = {}
    out = fit(spec, label, trials, fixed)
    out.lines[:0] = lines
    return out


def _finished_trials(storage: Storage, study_id: int, label: str, lines: list[str]) -> list[FrozenTrial]:
    """The earlier study's complete trials; where Optuna cannot read them all (a row changed by hand), each one it
    can, and one line for those it cannot."""
    try:
        return storage.optuna.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
    except UNREADABLE:
        pass
    query = sqlalchemy.text("SELECT trial_id, number FROM trials WHERE study_id = :id AND state = 'COMPLETE'")
    with storage.optuna.engine.connect() as conn:
        ids = conn.execute(query, {"id": study_id}).all()
    trials, unread = [], []
    for trial_id, number in ids:
        try:
            trials.append(storage.optuna.get_trial(trial_id))
        except UNREADABLE as exc:
            unread.append(f"{shown(number)} ({_why(exc)})")
    if unread:
        lines.append(f"warm start: {_count(unread, 'trial')} of {label} left out, unreadable: {_first(unread)}")
    return trials


MAX_LISTED = 10
"""Names or trials listed in one line; the rest are counted (a table of a million rows is still one line)."""


def _first(items: list[str]) -> str:
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return "; ".join(items[:MAX_LISTED]) + more


def _count(items: list[Any], word: str) -> str:
    return f"{len(items)} {word}{'' if len(items) == 1 else 's'}"


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
            f"{WHERE}: study {label} scored {shown(names[0])}, this one scores {spec.metric_names[0]}; its values "
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
    trials = list(trials)
    # A trial with no value is no result (it failed); one whose stored value is not a finite number was written by
    # hand, and is said.
    unscored = [f"{t.number} ({shown(_value(t), 20)})" for t in trials if not _scored(t) and _value(t) is not None]
    finished = sorted((t for t in trials if _scored(t)), key=lambda t: (sign * _quality(t), t.number))
    out = Plan(label, len(finished))
    if unscored:
        out.lines.append(
            f"warm start: {_count(unscored, 'trial')} of {label} left out, its value not a finite number: "
            f"{_first(unscored)}"
        )
    left_out: dict[str, list[str]] = {}
    unknown = sorted({k for t in finished for k in t.params} - set(spec.space))
    for name in unknown[:MAX_LISTED]:
        left_out[name] = [f"not a parameter of this study's [search.space] ({len(spec.space)} searched)"]
    if len(unknown) > MAX_LISTED:
        out.lines.append(f"warm start: {len(unknown) - MAX_LISTED} more parameters of {label} left out, not searched")
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
        out.lines.append(f"warm start: parameter {shown(name)} of {label} left out: {reasons[0]}{more}")
    return out


def _value(trial: FrozenTrial) -> Any:
    """The trial's quality objective (the first, in a one- or two-objective study) as stored; None where it has none."""
    return trial.values[0] if trial.values else None


def _scored(trial: FrozenTrial) -> bool:
    """Whether the trial's quality objective is a finite number (a row written by hand may hold the text 'NaN')."""
    value = _value(trial)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _quality(trial: FrozenTrial) -> float:
    """The quality objective of a ``_scored`` trial."""
    return float(_value(trial))


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
        except (ValueError, ArithmeticError):  # an integer of 5,000 digits: too long to compare or to print
            left_out.setdefault(name, []).append(f"{where}: not a number this space can hold")
    return params


def apply(study: optuna.Study, spec: StudySpec, warm: Plan) -> None:
    """Queue the plan's configurations and copy its results into the new ``study`` (study/studies.py ``_create``
    calls this once, under the creation lock), then record that it was applied."""
    for line in warm.lines:
        log.info("%s", shown(line, LINE))
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
