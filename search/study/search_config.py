"""The [search] table of a spec: the sampler, the pruner and the budget, each key with its limits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hpsearch.search.errors import SpecError
from hpsearch.storage import urls
from hpsearch.storage.errors import StorageUrlError
from hpsearch.storage.shown import shown
from hpsearch.trainer.config import MAX_STEPS, TASK_METRICS, TrainConfig

MAX_TRIALS = 100_000
"""Far beyond any search that ends (at a minute a trial, ten weeks on one device); a larger number is a typo
(2**70) that would start one that never does."""
LIMITS = {
    "max_retries": (100, ""),
    "timeout_minutes": (527_040.0, " (366 days)"),
    "gpu_hours": (1_000_000.0, ""),
    "keep_top_k": (MAX_TRIALS, ""),
    "max_disk_gb": (1_000_000.0, " (a petabyte)"),
    # Money is shown in full beside every figure: a larger number is a typo (1e308 printed 309 digits).
    "price_per_gpu_hour": (1_000_000.0, " per device hour (a typo beyond that: no device hour costs more)"),
    "budget": (1_000_000_000_000.0, " (a trillion: beyond that a budget is a typo, and prints as one)"),
    "pruner_startup_trials": (MAX_TRIALS, ""),
    "pruner_warmup_steps": (MAX_STEPS, ""),
    "pruner_min_resource": (MAX_STEPS, ""),
    "pruner_reduction_factor": (1000, ""),
    "early_point_rows": (10_000_000, ""),
    "prune_at_chance": (MAX_STEPS, ""),
}
"""Upper bounds of the other budget-like keys, each with how it reads."""

SAMPLERS = ("tpe", "random", "gp", "cmaes", "grid", "qmc")
QUALITY = tuple(dict.fromkeys(m for metrics in TASK_METRICS.values() for m in metrics if m != "perplexity"))
"""What a study is judged by on the validation split: its first (or only) objective, the one the pruner sees; which
of them a task has is checked with the model (search/study/spec.py)."""
COSTS = ("gpu_hours", "trainable_parameters", "peak_memory_gb")
"""What a trial's model cost, each minimised: a second objective (study/objectives.py reads each off the trial)."""
SINGLE_OBJECTIVE_ONLY = {"cmaes": "CMA-ES optimises one objective"}
"""Samplers that refuse a study with two objectives, with why."""
PRUNERS = ("none", "median", "percentile", "asha", "hyperband")


@dataclass
class SearchConfig:
    n_trials: int = 20
    """Trials to finish, counted across every worker of the study."""
    sampler: Literal["tpe", "random", "gp", "cmaes", "grid", "qmc"] = "qmc"
    """How parameters are proposed: qmc (scrambled Sobol, one sequence across all workers), tpe (multivariate,
    constant liar for parallel workers), random, gp (Gaussian process), cmaes (CMA-ES; floats and ints only), grid
    (every parameter needs choices or a step). Why qmc: docs/decisions.md, "Quasi-random search is the default
    sampler"."""
    pruner: Literal["none", "median", "percentile", "asha", "hyperband"] = "asha"
    """How hopeless trials are stopped early (resource unit: optimizer steps)."""
    metric: str | list[str] = "loss"
    """Objective on the validation split: loss (minimised), accuracy or macro F1 (maximised); or a list of two, that
    and what the model cost (gpu_hours, trainable_parameters, peak_memory_gb; minimised): a two-objective study
    whose answer is the Pareto front (docs/search.md, "Cost as a second objective")."""
    seed: int = 0
    """Seed of the sampler; each worker derives its own from it."""
    max_retries: int = 2
    """Times a trial whose worker crashed or was stopped is retried (resuming its checkpoint)."""
    pruner_warmup_steps: int = 0
    """median/percentile: optimizer steps before a trial may be pruned."""
    pruner_startup_trials: int = 2
    """median/percentile: finished trials needed before any trial is pruned."""
    pruner_percentile: float = 25.0
    """percentile: a trial is pruned below this percentile of the others at the same step."""
    pruner_min_resource: int = 0
    """asha/hyperband: optimizer steps of the first rung (0 = train.eval_every, the first validation point)."""
    pruner_reduction_factor: int = 3
    """asha/hyperband: 1 in this many trials is promoted to the next rung."""
    early_points: bool = True
    """Any pruner: validate also at early points below the first train.eval_every point (asha/hyperband: its rungs
    continued down, eval_every / pruner_reduction_factor^k, k = 1, 2; median/percentile: a quarter and half of the
    way there), where a trial that has learnt nothing (at its task's label prior) is cut at a small part of its cost
    (docs/search.md, "Early pruning points")."""
    early_point_rows: int = 512
    """Validation rows an early point scores: a fixed, seeded subset, the same in every trial (0 = all). A trial's
    value and its kept checkpoint come from full validation points only."""
    patient_pruning: bool = True
    """Any pruner: it is not asked about points that say little of a trial's hyperparameters, though they are
    reported (search/workers/early_stop.py; the rule: docs/search.md, "Pruners: stop hopeless trials early")."""
    prune_at_chance: int = 2
    """Any task but causal-lm, any pruner but none: stop a trial once this many validation points in a row, after its
    warm-up and first fifth of steps, were no better than its task's label prior (docs/tasks.md; docs/search.md,
    "Pruners: stop hopeless trials early"): a learning rate that does not learn or that diverged (0 = never)."""
    timeout_minutes: float = 0.0
    """Stop starting new trials after this many minutes of the study (0 = no limit)."""
    gpu_hours: float = 0.0
    """Stop starting new trials once the study's trials used this much device time, over every worker (0 = no limit)."""
    budget: float = 0.0
    """Stop starting new trials once the study's device time cost this much money (device hours x
    price_per_gpu_hour, in currency; 0 = no limit). Needs a price."""
    price_per_gpu_hour: float = 0.0
    """What an hour of one device costs, in currency: status, best and the summary show what the study and each
    trial cost (0 = no money shown)."""
    currency: str = ""
    """The currency of price_per_gpu_hour and budget, as it is shown ("CNY", "USD", "EUR")."""
    keep_top_k: int = 3
    """Keep the best checkpoints of this many top trials, study-wide; others are deleted."""
    max_disk_gb: float = 0.0
    """Cap on the kept best checkpoints (GB); the worst are deleted first (0 = no cap)."""
    warm_start: str = ""
    """An earlier study to start from: "NAME" (same storage) or "URL#NAME" (another storage, read only). Its best
    finished configurations run first and TPE/GP learn from its results; used once, when this study is created
    (search/study/warm_start.py; docs/search.md, "Warm start")."""

    def validate(self, where: str = "search") -> None:
        def rule(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise SpecError(f"{where}.{name}: {getattr(self, name)!r} {msg}")

        self._validate_objectives(where)
        rule(self.n_trials >= 1, "n_trials", "must be >= 1")
        # The samplers seed numpy generators, which take 0 ..2**32 - 1: any other seed failed every worker.
        rule(0 <= self.seed < 2**32, "seed", "must be between 0 and 4294967295 (2**32 - 1)")
        rule(self.n_trials <= MAX_TRIALS, "n_trials", f"must be at most {MAX_TRIALS:,}, a search that can end")
        for name in ("max_retries", "pruner_warmup_steps", "pruner_startup_trials"):
            rule(getattr(self, name) >= 0, name, "must be >= 0")
        rule(0 < self.pruner_percentile < 100, "pruner_percentile", "must be between 0 and 100 (exclusive)")
        rule(self.pruner_min_resource >= 0, "pruner_min_resource", "must be >= 0 (0 = train.eval_every)")
        rule(self.early_point_rows >= 0, "early_point_rows", "must be >= 0 (0 = every validation row)")
        rule(self.pruner_reduction_factor >= 2, "pruner_reduction_factor", "must be >= 2")
        rule(self.prune_at_chance >= 0, "prune_at_chance", "must be >= 0 (0 = never)")
        rule(self.keep_top_k >= 1, "keep_top_k", "must be >= 1 (the best trial's checkpoint is always kept)")
        for name in ("timeout_minutes", "gpu_hours", "max_disk_gb", "budget", "price_per_gpu_hour"):
            # inf passes ">= 0" and breaks arithmetic later (int(inf) in retention): 0 means no limit.
            value = getattr(self, name)
            zero = "no price" if name == "price_per_gpu_hour" else "no limit"
            rule(math.isfinite(value) and value >= 0, name, f"must be a finite number >= 0 (0 = {zero})")
        if self.warm_start:
            check_warm_start(self.warm_start, f"{where}.warm_start")
        for name, (most, words) in LIMITS.items():
            rule(getattr(self, name) <= most, name, f"must be at most {int(most):,}{words}")
        self._validate_money(where)

    def _validate_objectives(self, where: str) -> None:
        metric = [self.metric] if isinstance(self.metric, str) else self.metric
        said = f"{where}.metric: {self.metric!r}"
        if not isinstance(metric, list) or not all(isinstance(m, str) for m in metric) or not 1 <= len(metric) <= 2:
            raise SpecError(
                f'{said} must be one objective ("loss") or a list of two, quality then cost: ["accuracy", "gpu_hours"]'
            )
        if isinstance(self.metric, str) and self.metric not in QUALITY:
            raise SpecError(f"{said} must be one of {', '.join(map(repr, QUALITY))}")
        if metric[0] not in QUALITY:
            raise SpecError(f"{said}: the first objective must be one of {', '.join(QUALITY)}")
        if len(metric) == 2 and metric[1] not in COSTS:
            raise SpecError(f"{said}: the second objective must be one of {', '.join(COSTS)} (what a model cost)")
        if len(metric) == 2 and self.sampler in SINGLE_OBJECTIVE_ONLY:
            why = SINGLE_OBJECTIVE_ONLY[self.sampler]
            raise SpecError(
                f"{where}.sampler: {self.sampler!r} cannot search two objectives ({why}); "
                'use sampler = "tpe" (or "qmc", "random", "gp", "grid"), or a single metric'
            )

    def _validate_money(self, where: str) -> None:
        if self.budget > 0 and self.price_per_gpu_hour <= 0:
            raise SpecError(
                f"{where}.budget: {self.budget!r} is money and needs a price: set price_per_gpu_hour "
                "(and currency), or give the budget in device hours with gpu_hours"
            )
        # Shown beside every figure, and in a one-line log: a short code, not a sentence.
        if len(self.currency) > 8 or not self.currency.isprintable() or " " in self.currency:
            # Quoted and cut: a 10,000-character value is not echoed whole.
            shown_value = shown(repr(self.currency), 40)
            raise SpecError(f'{where}.currency: {shown_value} must be a short code like "CNY", "USD" or "€"')

    def check_steps(self, train: TrainConfig, where: str = "search") -> None:
        """Refuse a pruner that could judge a trial only at its last step, where stopping it saves nothing: its
        first rung (asha/hyperband) or warm-up (median/percentile) at or beyond ``train.max_steps``. Every other
        combination of eval_every, max_steps, epochs and early points works for any length of run: points below
        the first full one are dropped where they do not fit (sampling.early_points), and a run shorter than
        eval_every validates at its last step (trainer/evaluate.py point_at)."""
        most = train.max_steps
        if not most or self.pruner == "none":
            return
        name = "pruner_min_resource" if self.pruner in ("asha", "hyperband") else "pruner_warmup_steps"
        if getattr(self, name) >= most:
            zero = " (0 = the first validation point)" if name == "pruner_min_resource" else ""
            raise SpecError(
                f"{where}.{name}: {getattr(self, name)} is not below train.max_steps ({most}): the {self.pruner} "
                f"pruner could judge a trial only at its last step, where stopping it saves nothing; lower it{zero}, "
                'or set pruner = "none"'
            )

    @property
    def objectives(self) -> tuple[str, ...]:
        """The quality objective, then the cost objective of a two-objective study."""
        return (self.metric,) if isinstance(self.metric, str) else tuple(self.metric)

    @property
    def quality(self) -> str:
        """The objective on the validation split (loss, or a metric of the task): what the trainer and pruner judge."""
        return self.objectives[0]

    @property
    def cost(self) -> str | None:
        """The second objective (gpu_hours, trainable_parameters, peak_memory_gb), or None in a single-objective
        study."""
        return self.objectives[1] if len(self.objectives) > 1 else None


def check_warm_start(value: str, where: str) -> tuple[str | None, str]:
    """``[search] warm_start`` as (storage URL or None for this study's own, study name), its form checked; the
    study itself is looked up only by `start` (search/study/warm_start.py)."""
    fix = 'write "NAME" (a study in the same storage) or "URL#NAME"'
    if "://" in value and "#" not in value:
        raise SpecError(f"{where}: {urls.mask(value)!r} names a storage but no study; {fix}")
    url, name = value.rsplit("#", 1) if "://" in value else (None, value)
    if not name.strip():
        raise SpecError(f"{where}: {value!r} names no study; {fix}")
    if url is not None:
        try:
            urls.parse(url)
            # The spec is stored with the study and shown on the dashboard: no secret belongs in it, in any form
            # the driver reads (user:password@, ?password=, %70assword=, ?sslpassword=, a ?dsn= conninfo).
            urls.refuse_secrets(url)
        except StorageUrlError as exc:
            raise SpecError(f"{where}: {exc}") from None
    return url, name
