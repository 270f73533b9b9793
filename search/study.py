"""Creating, resuming and loading studies; the sampler and pruner a spec asks for."""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

import optuna

from hpsearch.search.spec import SPEC_ATTR, SpecError, StudySpec, difference
from hpsearch.storage.open import Storage, require_study

log = logging.getLogger(__name__)
N_TRIALS_ATTR = "hpsearch_n_trials"


class SpecMismatchError(SpecError):
    """A study exists with another spec."""


def create_or_resume(storage: Storage, name: str, spec: StudySpec) -> optuna.Study:
    """Create the study with ``spec``, or check that the existing one was made with the same."""
    study = optuna.create_study(
        study_name=name, storage=storage.optuna, direction=spec.direction, load_if_exists=True
    )
    stored = study.user_attrs.get(SPEC_ATTR)
    if stored is None:
        study.set_user_attr(SPEC_ATTR, spec.to_dict())
        log.info("created study %s in %s", name, storage.display)
    else:
        check_same(name, StudySpec.from_dict(stored), spec)
        log.info("resuming study %s (%d trials so far)", name, len(study.trials))
    study.set_user_attr(N_TRIALS_ATTR, spec.search.n_trials)
    return study


def check_same(name: str, stored: StudySpec, given: StudySpec) -> None:
    diff = difference(stored.identity(), given.identity())
    if diff:
        raise SpecMismatchError(
            f"study {name!r} exists with a different spec ({diff}); start a new study with "
            "another --study name, or run without --config to resume it with its stored spec"
        )


def stored_spec(storage: Storage, name: str) -> StudySpec:
    study_id = require_study(storage, name)
    attrs = storage.optuna.get_study_user_attrs(study_id)
    if SPEC_ATTR not in attrs:
        raise SpecError(
            f"study {name!r} was not created by hpsearch (it has no stored spec); create one with "
            "`hpsearch start --study NAME --config FILE`"
        )
    return StudySpec.from_dict(attrs[SPEC_ATTR])


def check_spec_before_create(storage: Storage, name: str, spec: StudySpec) -> None:
    """Raise on a spec mismatch without writing anything (bad input leaves storage untouched)."""
    try:
        study_id = storage.optuna.get_study_id_from_name(name)
    except KeyError:
        return
    stored = storage.optuna.get_study_user_attrs(study_id).get(SPEC_ATTR)
    if stored is not None:
        check_same(name, StudySpec.from_dict(stored), spec)


def n_trials(study: optuna.Study, spec: StudySpec) -> int:
    return int(study.user_attrs.get(N_TRIALS_ATTR, spec.search.n_trials))


def worker_seed(spec: StudySpec, place: str, n_existing: int) -> int:
    """A sampler seed per worker: with one shared seed, parallel workers (and a resumed run)
    would draw the same random start-up trials. Mixing in the host/device and the study's
    progress keeps a single-worker search reproducible from ``search.seed``."""
    return (spec.search.seed * 1_000_003 + zlib.crc32(place.encode()) + n_existing * 7919) % 2**31


def make_sampler(spec: StudySpec, seed: int) -> optuna.samplers.BaseSampler:
    if spec.search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # multivariate TPE models the interaction of parameters (lr x warmup); the constant liar
    # treats running trials as bad so parallel workers do not pile onto the same region.
    n_startup = max(3, min(10, spec.search.n_trials // 3))
    return optuna.samplers.TPESampler(
        seed=seed, multivariate=True, constant_liar=True, n_startup_trials=n_startup
    )


def make_pruner(spec: StudySpec, total_steps_hint: int | None = None) -> optuna.pruners.BasePruner:
    kind = spec.search.pruner
    if kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "median":
        # Few validation points per fine-tune: judge after 2 finished trials, not optuna's 5.
        return optuna.pruners.MedianPruner(
            n_startup_trials=2, n_warmup_steps=spec.search.pruner_warmup_steps
        )
    min_resource = max(1, spec.train.eval_every)
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
    return optuna.pruners.HyperbandPruner(
        min_resource=min_resource, max_resource=total_steps_hint or "auto", reduction_factor=3
    )


def suggest(trial: optuna.trial.BaseTrial, spec: StudySpec) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, p in spec.space.items():
        if p.type == "categorical":
            params[name] = trial.suggest_categorical(name, p.choices)  # type: ignore[arg-type]
        elif p.type == "int":
            params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log, step=int(p.step or 1))  # type: ignore[arg-type]
        else:
            params[name] = trial.suggest_float(name, p.low, p.high, log=p.log, step=p.step)  # type: ignore[arg-type]
    return params


def spec_json(spec: StudySpec) -> str:
    return json.dumps(spec.to_dict(), indent=2, sort_keys=True)
