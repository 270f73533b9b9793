"""Where a trial's validation points go and which rows each scores: full points every ``train.eval_every`` steps
(every row, or ``data.validation_rows`` of them), and the search's early points below the first, kept only where they
cost less than they can save. The search says whether a trial has early points and at which factor (its pruner's:
search/workers/early_stop.py ``early_points``), the loop validates where :func:`point_at` says (trainer/loop.py),
and what an early point decides is the pruner's (early_stop.py again)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hpsearch.trainer.holdout import drawn_rows
from hpsearch.trainer.tokenised import Encoded

if TYPE_CHECKING:
    from hpsearch.trainer.config import DataConfig


@dataclass(frozen=True)
class EarlyPoints:
    """Validation points the search asks for before a trial's first ``eval_every`` point, where its pruner can cut a
    hopeless trial at a small part of its cost. Each is scored on the same seeded subset of ``rows`` validation rows
    in every trial (all of them when ``rows`` is 0 or not fewer), reported and judged, never saved from: a trial's
    value and its kept checkpoint come from full points only (docs/search.md, "Early pruning points")."""

    steps: frozenset[int] = frozenset()
    rows: int = 0
    seed: int = 0

    def data(self, validation: Encoded) -> Encoded:
        """The rows an early point scores: a fixed draw, so every trial (and every rank) is judged on the same."""
        if not 0 < self.rows < len(validation):
            return validation
        return validation.subset(sorted(random.Random(self.seed).sample(range(len(validation)), self.rows)))


@dataclass(frozen=True)
class PointRows:
    """``data.validation_rows``: every full point of every trial scored on the same ``rows`` validation rows, drawn
    by ``data.split_seed`` (the study's: trials, workers and hosts draw alike), and the trial's best re-scored on all
    of them at its end, for the trial's value (loop.py). 0, or not fewer than the split holds: every row."""

    rows: int = 0
    seed: int = 0

    @classmethod
    def of(cls, cfg: DataConfig) -> PointRows:
        return cls(cfg.validation_rows, cfg.split_seed)

    def active(self, validation: Encoded) -> bool:
        return 0 < self.rows < len(validation)

    def data(self, validation: Encoded) -> Encoded:
        if not self.active(validation):
            return validation
        return validation.subset(drawn_rows(len(validation), self.rows, self.seed))


def point_at(step: int, total_steps: int, eval_every: int, early: EarlyPoints) -> Literal["full", "early"] | None:
    """What the loop does after optimizer step ``step`` (1 = the first) of ``total_steps``: a full validation point
    every ``eval_every`` steps and at the last step, so a run shorter than ``eval_every`` still has one; an early
    point at the search's early steps that are not full ones; else nothing. The one rule of where points go."""
    if step % eval_every == 0 or step == total_steps:
        return "full"
    return "early" if step in early.steps else None


def early_steps(first: int, factor: int, batch_size: int, rows: int, n_validation: int, seed: int) -> EarlyPoints:
    """The early points below a trial's first full point at step ``first``: ``first / factor`` and
    ``first / factor^2`` (asha/hyperband's rungs continued down; a half and a quarter of the way for the others),
    each kept only where validating costs less than the training it could save: scoring a row forward costs about a
    third of training on it (forward 1, backward 2), and a cut here instead of at the next point saves that many
    steps of ``batch_size`` rows. ``rows``: the validation rows an early point scores (0: all ``n_validation``).
    An early point cuts only a flat curve, which takes two points: one kept alone is none."""
    candidates = sorted({first // factor, first // factor**2} - {0})
    scored = min(rows or n_validation, n_validation)
    # Each candidate with the point after it (the next candidate, or the first full point): none at all where the
    # first full point comes at step 1 or 2 (a short run, eval_every 1).
    following = [*candidates, first][1:]
    kept = [step for step, after in zip(candidates, following, strict=True) if scored / 3 < (after - step) * batch_size]
    if len(kept) < 2:  # one point alone never cuts: it has no earlier one to be flat against
        return EarlyPoints()
    return EarlyPoints(frozenset(kept), scored, seed)
