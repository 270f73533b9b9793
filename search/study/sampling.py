"""What Optuna is given to search with: the sampler and the pruner a spec names, each parameter's distribution,
and the parameters a trial draws from them."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import optuna

from hpsearch.search.study.space import Param
from hpsearch.search.study.spec import StudySpec

if TYPE_CHECKING:
    pass


def worker_seed(spec: StudySpec, place: str, n_existing: int) -> int:
    """A sampler seed per worker: with one shared seed, parallel workers (and a resumed run) would draw the same
    random start-up trials. Mixing in host/device and progress keeps one worker reproducible from ``search.seed``."""
    return (spec.search.seed * 1_000_003 + zlib.crc32(place.encode()) + n_existing * 7919) % 2**31


def make_sampler(spec: StudySpec, seed: int) -> optuna.samplers.BaseSampler:
    kind = spec.search.sampler
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "qmc":
        from hpsearch.search.study.sobol import SobolSampler

        # One scramble for the whole study (not the worker's seed): workers share the sequence.
        return SobolSampler({name: distribution(p) for name, p in spec.space.items()}, spec.search.seed)
    if kind == "grid":
        # GridSampler shuffles the grid with its seed and stores only each trial's index into
        # it: every worker (and a resumed study) must shuffle alike, so the study's seed, not
        # the worker's, or index 2 means another point to each and points run twice or never.
        return optuna.samplers.GridSampler(grid_space(spec), seed=spec.search.seed)
    n_startup = max(3, min(10, spec.search.n_trials // 3))
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup)
    if kind == "cmaes":
        # Pruned trials carry their last value: CMA-ES learns from them too (consider_pruned_trials).
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=n_startup, consider_pruned_trials=True, warn_independent_sampling=False
        )
    # multivariate TPE models the interaction of parameters (lr x warmup); the constant liar
    # treats running trials as bad so parallel workers do not pile onto the same region.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=n_startup)


def grid_space(spec: StudySpec) -> dict[str, list[Any]]:
    """Every point of every parameter (spec validation guarantees choices or a step)."""
    return {name: p.grid() for name, p in spec.space.items()}


def make_pruner(spec: StudySpec) -> optuna.pruners.BasePruner:
    """The spec's pruner, in optimizer steps. Its defaults suit a few validation points a trial (docs/decisions.md,
    "Patient pruning"): asha/hyperband's first rung is ``train.eval_every``, not optuna's guess from the first trial
    (below it, the trial's early points: :func:`early_points`)."""
    s = spec.search
    kind = s.pruner
    if kind == "none":
        return optuna.pruners.NopPruner()
    judged = {"n_startup_trials": s.pruner_startup_trials, "n_warmup_steps": s.pruner_warmup_steps}
    if kind == "median":
        return optuna.pruners.MedianPruner(**judged)
    if kind == "percentile":
        return optuna.pruners.PercentilePruner(s.pruner_percentile, **judged)
    min_resource = s.pruner_min_resource or max(1, spec.train.eval_every)
    rungs = {"min_resource": min_resource, "reduction_factor": s.pruner_reduction_factor}
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(**rungs)
    return optuna.pruners.HyperbandPruner(max_resource="auto", **rungs)


def distribution(p: Param) -> optuna.distributions.BaseDistribution:
    """The one place a spec parameter becomes an optuna distribution: ``suggest`` asks for it,
    and the qmc sampler proposes values for it (optuna uses them only when the two agree)."""
    d = optuna.distributions
    if p.type == "categorical":
        return d.CategoricalDistribution(list(p.choices or []))
    if p.type == "int":
        return d.IntDistribution(int(p.low or 0), int(p.high or 0), log=p.log, step=int(p.step or 1))
    return d.FloatDistribution(float(p.low or 0), float(p.high or 0), log=p.log, step=p.step)


def suggest(trial: optuna.trial.BaseTrial, spec: StudySpec) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, p in spec.space.items():
        dist = distribution(p)
        if isinstance(dist, optuna.distributions.CategoricalDistribution):
            params[name] = trial.suggest_categorical(name, list(dist.choices))
        elif isinstance(dist, optuna.distributions.IntDistribution):
            params[name] = trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
        else:
            assert isinstance(dist, optuna.distributions.FloatDistribution)
            params[name] = trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)
    return params
