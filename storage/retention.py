"""Study-wide checkpoint retention: only the best checkpoints of the top ``keep_top_k`` trials stay on disk.

After every trial its worker calls :func:`retain`: the ranking is study-wide, but each host deletes only
``trial-N/best`` of its own study folder, never a path a row names (see trialdir.py), and marks the trial's
``best_checkpoint`` deleted (deletions.py) so that nobody goes looking for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.storages import RDBStorage

from hpsearch.storage import attrs, deletions
from hpsearch.storage.trialdir import TrialDir

log = logging.getLogger(__name__)


def rank(value: float, loss: float | None, number: int, *, minimize: bool) -> tuple[float, float, int]:
    """Sort key of a finished trial, best first: its objective, then the validation loss of its best point (see
    docs/decisions.md, "A tie goes to the lower validation loss"), then the earlier trial. ``hpsearch best`` picks
    by this key too, so the best trial is always one whose checkpoint is kept."""
    return (value if minimize else -value, math.inf if loss is None else loss, number)


def recorded_loss(user_attrs: dict[str, Any]) -> float | None:
    """The best point's validation loss from a trial's attributes (None for a trial without one)."""
    loss = user_attrs.get(attrs.BEST_LOSS)
    return float(loss) if isinstance(loss, int | float) else None


@dataclass(frozen=True)
class Candidate:
    """A finished trial whose best checkpoint may be on this host's disk."""

    trial_id: int
    number: int
    value: float
    path: Path
    loss: float | None = None  # the validation loss at its best point: breaks ties of an accuracy or F1 objective
    off_front: bool = False  # a two-objective study's trial not on its Pareto front: ranked after all that are


@dataclass(frozen=True)
class Deletion:
    candidate: Candidate
    reason: str


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # another worker deleted it meanwhile
                total += (Path(root) / name).stat().st_size
    return total


def plan(
    candidates: Iterable[Candidate],
    *,
    keep_top_k: int,
    minimize: bool,
    max_disk_bytes: int = 0,
    sizes: dict[Path, int] | None = None,
) -> list[Deletion]:
    """Which checkpoints to delete: all but the top ``keep_top_k`` (a Pareto front's trials first, by their
    quality objective), then the worst kept ones while the kept set is over ``max_disk_bytes`` (0 = no cap). The
    best is never deleted."""
    ranked = sorted(candidates, key=lambda c: (c.off_front, rank(c.value, c.loss, c.number, minimize=minimize)))
    kept = ranked[:keep_top_k]
    chosen = [Deletion(c, f"not in the study's top {keep_top_k}") for c in ranked[keep_top_k:]]
    if max_disk_bytes > 0:
        sizes = sizes if sizes is not None else {c.path: disk_bytes(c.path) for c in kept}
        total = sum(sizes.get(c.path, 0) for c in kept)
        while len(kept) > 1 and total > max_disk_bytes:
            worst = kept.pop()
            total -= sizes.get(worst.path, 0)
            chosen.append(Deletion(worst, f"max_disk_gb cap of {max_disk_bytes / 1e9:g} GB"))
    return chosen


def candidate(
    trial_id: int, number: int, value: float, root: Path, user_attrs: dict[str, Any], *, off_front: bool = False
) -> Candidate:
    """A complete trial as retention ranks it: its checkpoint, wherever the trial ran, is looked
    for at ``trial-N/best`` of this host's study folder ``root``, not at the path it recorded."""
    return Candidate(trial_id, number, value, TrialDir(root, number).best, recorded_loss(user_attrs), off_front)


def retain(
    storage: RDBStorage,
    study: str,
    candidates: list[Candidate],
    *,
    keep_top_k: int,
    minimize: bool,
    max_disk_gb: float = 0.0,
) -> list[Deletion]:
    """Delete the checkpoints :func:`plan` picks that exist here and mark their trials of ``study``.

    ``candidates`` are every finished trial of the study (other hosts' too), made by :func:`candidate`. One an
    export is copying (``hpsearch best --export``) waits for the next pass."""
    local = {c.path: disk_bytes(c.path) for c in candidates if c.path.exists()}
    planned = plan(
        candidates, keep_top_k=keep_top_k, minimize=minimize, max_disk_bytes=int(max_disk_gb * 1e9), sizes=local
    )
    done: list[Deletion] = []
    for d in planned:
        c = d.candidate
        folder = TrialDir(c.path.parent.parent, c.number)
        if c.path not in local or folder.best != c.path:  # not made by candidate(): no path of a row is deleted
            continue
        with folder.deleting() as free:
            if not free:
                log.info("trial %d's checkpoint is being exported; deleted at a later pass", c.number)
                continue
            if not folder.remove(folder.best):
                continue
        deletions.mark_deleted(storage, study, c.trial_id, attrs.BEST_CHECKPOINT, d.reason)
        log.info("deleted the checkpoint of trial %d (%s)", c.number, d.reason)
        done.append(d)
    return done
