"""When a run is stopped early: by its own chance test, or by the search's pruner.

The search's rules, not the trainer's: ``EarlyStop`` sits between the trainer and the trial's
reporter, sees every validation point, and answers the trainer's ``should_prune``. The rules and
why: docs/search.md, "Pruners"; docs/decisions.md, "Patient pruning", "The chance stop" and
"Early stopping belongs to the search" (why a run at chance stops only once an outage's backlog
has gone through). A run on several ranks is judged on rank 0 alone."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpsearch.trainer.report import FailReason, Reporter
from hpsearch.trainer.task_names import CLASSIFICATION, IGNORE_INDEX, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION
from hpsearch.trainer.tokenised import Encoded

if TYPE_CHECKING:
    from pathlib import Path

    from hpsearch.search.study.search_config import SearchConfig
    from hpsearch.search.study.spec import StudySpec
    from hpsearch.trainer.config import TrainConfig
    from hpsearch.trainer.evaluate import Metrics
    from hpsearch.trainer.points import EarlyPoints
    from hpsearch.trainer.stats import Figures
    from hpsearch.trainer.tokenised import Prepared

log = logging.getLogger(__name__)
RANK_JUDGED_FROM = 3
"""A study that searches the LoRA rank is not judged by its pruner in the first 1/this of a trial's steps."""


FLAT = 0.01
"""An early point's curve is flat when its loss fell by less than this share of the label prior's entropy since the
previous early point (0.007 nats for two balanced labels)."""


@dataclass(frozen=True)
class ChanceLevel:
    """The label prior of a task's validation split: the loss (and accuracy) of the best constant prediction
    (docs/tasks.md, "The chance stop"). Classification and token-classification: the class (tag) frequencies, the
    loss their entropy and the accuracy the majority's share. Regression: the labels' mean, the loss their variance.
    Multi-label: each label's frequency, the loss the mean of their binary entropies. Causal LM: none."""

    loss: float  # the loss of the best constant prediction
    accuracy: float | None  # share of the most frequent validation label; None: the loss alone is judged
    margin: float = 0.0  # one standard error of an accuracy at that rate on this many examples

    @classmethod
    def of(cls, labels: Sequence[int]) -> ChanceLevel | None:
        """From the validation labels; None without labels (causal LM, empty split)."""
        if not labels:
            return None
        n = len(labels)
        shares = [c / n for c in Counter(labels).values()]
        top = max(shares)
        return cls(loss=-sum(p * math.log(p) for p in shares), accuracy=top, margin=math.sqrt(top * (1 - top) / n))

    @classmethod
    def of_split(cls, split: Encoded) -> ChanceLevel | None:
        """The prior of ``split``'s task (see the class); None for a causal LM or an empty split."""
        if split.task == TOKEN_CLASSIFICATION:
            return cls.of([tag for tags in split.token_labels for tag in tags if tag != IGNORE_INDEX])
        if split.task == REGRESSION and split.scores:
            values = [row[0] for row in split.scores]
            mean = sum(values) / len(values)
            return cls(loss=sum((v - mean) ** 2 for v in values) / len(values), accuracy=None)
        if split.task == MULTI_LABEL and split.scores:
            shares = [sum(column) / len(split.scores) for column in zip(*split.scores, strict=True)]
            entropies = [-(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else 0.0 for p in shares]
            return cls(loss=sum(entropies) / len(entropies), accuracy=None)
        return cls.of(split.labels) if split.task == CLASSIFICATION else None

    def matches(self, metrics: Metrics) -> bool:
        """Whether a validation point is no better than the label prior."""
        return self._accuracy_at_chance(metrics) and metrics.loss >= self.loss

    def not_yet_seen(self, metrics: Metrics) -> bool:
        """Whether the loss has left the prior's but accuracy has not (often the label frequencies, learnt first)."""
        return self.accuracy is not None and self._accuracy_at_chance(metrics) and metrics.loss < self.loss

    def _accuracy_at_chance(self, metrics: Metrics) -> bool:
        """Accuracy within a standard error of the majority rate, at a finite loss (a prior without an accuracy:
        any finite loss)."""
        if not math.isfinite(metrics.loss):
            return False
        if self.accuracy is None:
            return True
        return metrics.accuracy is not None and metrics.accuracy <= self.accuracy + self.margin


@dataclass
class PruningGate:
    """Counts a run's points at chance, and says when the pruner may judge a point."""

    chance: ChanceLevel | None  # of the validation labels; None for a causal LM (no chance test, no accuracy)
    warmup: int
    total_steps: int
    metric: str
    prune_at_chance: int = 0  # stop after this many judged points in a row at chance (0 = never)
    patient: bool = False  # ask the pruner only about points that say something of the hyperparameters
    rank_searched: bool = False  # the study searches the LoRA rank: see rank_judged_from
    at_chance: int = 0
    early: frozenset[int] = frozenset()  # the trial's early pruning points (sampling.early_points)
    early_seen: tuple[int, float] | None = None  # the step and loss of the last early point

    @classmethod
    def of_search(
        cls,
        data: Any,
        cfg: Any,
        search: SearchConfig,
        *,
        rank_searched: bool = False,
        early: frozenset[int] = frozenset(),
    ) -> PruningGate:
        """The gate the spec's search section asks for: the chance stop with every pruner but none; ``early``: the
        trial's early points (sampling.early_points)."""
        prune_at_chance = search.prune_at_chance if search.pruner != "none" else 0
        gate = cls.of_run(data, cfg, search.quality, prune_at_chance=prune_at_chance, patient=search.patient_pruning)
        return replace(gate, rank_searched=rank_searched, early=early)

    @classmethod
    def of_run(cls, data: Any, cfg: Any, metric: str, *, prune_at_chance: int, patient: bool) -> PruningGate:
        """The gate of a run of ``cfg`` on ``data`` (a trainer ``Prepared``), planned as fit plans it."""
        from hpsearch.trainer.optim import plan_steps, warmup_steps

        total, _ = plan_steps(len(data.train), cfg.batch_size, cfg.epochs, cfg.max_steps)
        chance = ChanceLevel.of_split(data.validation)
        return cls(chance, warmup_steps(cfg, total), total, metric, prune_at_chance=prune_at_chance, patient=patient)

    @property
    def rank_judged_from(self) -> int:
        """First step the pruner may judge a trial of a study that searches the LoRA rank (0 otherwise): a third of
        its steps. Early on, LoRA runs of different ranks follow one curve; a low rank falls behind only once its
        capacity runs out (docs/decisions.md, "Rank is judged late"), so an early cut would judge noise."""
        return -(-self.total_steps // RANK_JUDGED_FROM) if self.rank_searched else 0

    @property
    def judged_from(self) -> int:
        """First step a run is judged at chance: after its warm-up and a fifth of its steps (any run is at
        chance at first, and a long run may validate every few steps)."""
        return max(self.warmup, -(-self.total_steps // 5))

    def see(self, step: int, metrics: Metrics) -> None:
        """Count the points in a row, from judged_from on, that were no better than chance."""
        matches = self.chance is not None and step >= self.judged_from and self.chance.matches(metrics)
        self.at_chance = self.at_chance + 1 if matches else 0

    def cut_early(self, step: int, metrics: Metrics) -> bool | None:
        """At an early point of a trial with a label prior (every task but causal-lm): whether it has learnt nothing
        (cut it) or may have (go on); None elsewhere (the pruner decides). Among trials that learn, a curve this
        short favours the fastest learner (a high learning rate), not the best, so an early point cuts only a flat
        curve at chance: at the label prior's loss or above, and less than FLAT of it lower than at the previous
        early point (in the first steps a good learning rate is at the prior too, but its loss is falling;
        docs/search.md, "Early pruning points")."""
        if step not in self.early or self.chance is None:
            return None
        previous, self.early_seen = self.early_seen, (step, metrics.loss)
        if previous is None:
            return False
        return self.at_peak(previous[0], step) * (previous[1] - metrics.loss) < FLAT * self.chance.loss and (
            self.chance.matches(metrics)
        )

    def at_peak(self, start: int, end: int) -> float:
        """How many times more the steps from ``start`` to ``end`` would have moved the weights at the peak learning
        rate than under the schedule: a loss change between two points times this is what the trial's learning rate
        does, whether or not it is still warming up (early on, the change is about the rate summed over the steps)."""
        from hpsearch.trainer.optim import lr_factor

        applied = sum(lr_factor(t, self.warmup, self.total_steps) for t in range(start, end))
        return (end - start) / applied if applied > 0 else math.inf

    @property
    def stuck(self) -> bool:
        return 0 < self.prune_at_chance <= self.at_chance

    def may_prune(self, step: int, metrics: Metrics) -> bool:
        if not self.patient:
            return True
        if step < max(self.warmup, self.rank_judged_from):
            return False
        unseen = self.metric != "loss" and self.chance is not None and self.chance.not_yet_seen(metrics)
        return not (unseen and step < self.judged_from)


class EarlyStop:
    """The trial's reporter as the trainer sees it: ``should_prune`` is True once the run is stuck
    at chance (``reason`` then says so), else the pruner's answer where the gate allows."""

    def __init__(self, inner: Reporter, gate: PruningGate) -> None:
        self.inner, self.gate = inner, gate
        self.reason: FailReason | None = None  # why the run was pruned, where the pruner was not the one to decide
        self._last: tuple[int, Metrics] | None = None

    def report(self, value: float, step: int, metrics: Metrics | None = None) -> None:
        if metrics is not None:
            self.gate.see(step, metrics)
            self._last = (step, metrics)
        self.inner.report(value, step, metrics)

    def should_prune(self) -> bool:
        if self._last is None:
            return False
        step, metrics = self._last
        if self.gate.stuck:
            log.info("step %d: no better than the label prior %d points in a row: stopping", step, self.gate.at_chance)
            self.reason = FailReason.AT_CHANCE
            return True
        early = self.gate.cut_early(step, metrics)
        if early is not None:
            if early:
                log.info("step %d: an early point at chance level (the label prior's loss): stopping", step)
                self.reason = FailReason.AT_CHANCE
            return early
        return self.gate.may_prune(step, metrics) and self.inner.should_prune()

    # What the run says of its files and figures: the trial's, unchanged (the search's rules judge only points).
    @property
    def immediate(self) -> bool:
        return self.inner.immediate

    def best_saved(self, path: Path, step: int, values: dict[str, float]) -> None:
        self.inner.best_saved(path, step, values)

    def state_saved(self, path: Path) -> None:
        self.inner.state_saved(path)

    def resumed(self, step: int) -> None:
        self.inner.resumed(step)

    def measured(self, figures: Figures) -> None:
        self.inner.measured(figures)


def early_points(spec: StudySpec, cfg: TrainConfig, data: Prepared) -> EarlyPoints:
    """Whether a trial gets early points, and at which factor: its pruner's rungs continued down (asha/hyperband:
    the reduction factor), a half and a quarter of the way for the others; none without a pruner or with
    ``search.early_points = false``. Which steps, and which rows each scores: trainer/points.py."""
    from hpsearch.trainer.optim import plan_steps
    from hpsearch.trainer.points import EarlyPoints, early_steps

    s = spec.search
    if s.pruner == "none" or not s.early_points:
        return EarlyPoints()
    total_steps, _ = plan_steps(len(data.train), cfg.batch_size, cfg.epochs, cfg.max_steps)
    factor = s.pruner_reduction_factor if s.pruner in ("asha", "hyperband") else 2
    first = min(cfg.eval_every, total_steps)
    return early_steps(first, factor, cfg.batch_size, s.early_point_rows, len(data.validation), s.seed)
