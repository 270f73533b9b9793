"""The `qmc` sampler: trial N gets point N of one scrambled Sobol sequence (docs/search.md, "Samplers, seeds and
known-good starting points"). optuna's ``QMCSampler`` reads and writes its sequence position in two steps, so two
workers asking at once can get the same point; the trial number is handed out atomically, so no point runs twice.
Every worker must therefore share the scramble seed (``search.seed``), not derive its own."""

from __future__ import annotations

import math
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import Study
from optuna.trial import FrozenTrial
from scipy.stats import qmc


def scale(u: float, dist: BaseDistribution) -> Any:
    """The point of ``dist`` at quantile ``u`` in [0, 1): uniform on the log scale where asked."""
    if isinstance(dist, CategoricalDistribution):
        return dist.choices[min(int(u * len(dist.choices)), len(dist.choices) - 1)]
    assert isinstance(dist, (FloatDistribution, IntDistribution))
    low, high = float(dist.low), float(dist.high)
    if dist.step is not None and not dist.log:  # an int range always has a step (1 when log)
        # Each of the n grid points gets an equal share of [0, 1).
        n = math.floor((high - low) / dist.step + 1e-9) + 1
        value = low + min(int(u * n), n - 1) * dist.step
    elif dist.log:  # a log int rounds on the log scale, within the range
        a, b = (low - 0.5, high + 0.5) if isinstance(dist, IntDistribution) else (low, high)
        value = math.exp(math.log(a) + u * (math.log(b) - math.log(a)))
    else:
        value = low + u * (high - low)
    if isinstance(dist, IntDistribution):
        return int(min(max(round(value), dist.low), dist.high))
    return min(max(value, low), high)


class SobolSampler(BaseSampler):
    def __init__(self, space: dict[str, BaseDistribution], seed: int) -> None:
        self._space = dict(space)
        self._seed = seed
        # Parameters outside the spec's space (none today) fall back to plain random draws.
        self._fallback = RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        # The scramble seed stays: every worker must walk the same sequence.
        self._fallback.reseed_rng()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._space)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        names = list(search_space)
        engine = qmc.Sobol(len(names), scramble=True, seed=self._seed)
        if trial.number > 0:
            engine.fast_forward(trial.number)
        return {name: scale(float(u), search_space[name]) for name, u in zip(names, engine.random(1)[0], strict=True)}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)
