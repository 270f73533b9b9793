"""Which of a trial's checkpoints hpsearch deleted, and why: the one writer (``mark_deleted``) and the one reader
(``attributes``) of that fact.

A trial's ``best_checkpoint`` and ``resume_checkpoint`` stay the paths they were, for life: a script that reads one
as a path keeps working. That its folder went is another attribute, ``best_checkpoint_deleted`` (or
``resume_checkpoint_deleted``), whose value says why. Optuna takes no attribute on a finished trial through any
public call (its storages' ``check_trial_is_updatable``), and retention deletes the checkpoints of finished trials,
so the fact is stored, through Optuna's public ``set_study_user_attr``, as a *study* user attribute keyed by the
trial (attrs.py ``deleted_key``) and read back onto the trial here: every view of a trial (status, best, export, the
Python API) reads its attributes through ``attributes``. One key per trial and checkpoint: two hosts marking two
trials at once write two rows, and neither loses the other's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial

from hpsearch.storage import attrs

log = logging.getLogger(__name__)

# The attribute that says a recorded path's folder is gone, by the attribute that records the path.
DELETED = {
    attrs.BEST_CHECKPOINT: attrs.BEST_CHECKPOINT_DELETED,
    attrs.RESUME_CHECKPOINT: attrs.RESUME_CHECKPOINT_DELETED,
}
# What hpsearch wrote into best_checkpoint itself before it stayed a path: "deleted (WHY; was PATH)" or
# "deleted (WHY)". Studies made then are read as if marked now.
_OLD_NOTE = re.compile(r"deleted \((?P<why>.*?)(?:; was (?P<was>.*))?\)", re.DOTALL)


def mark_deleted(storage: RDBStorage, study: str, trial_id: int, key: str, why: str) -> None:
    """Record that the folder ``key`` (``best_checkpoint`` or ``resume_checkpoint``) of trial ``trial_id`` of study
    ``study`` names went, for ``why``. Only where the trial recorded one: a trial that saved none has none to lose."""
    trial = storage.get_trial(trial_id)
    if not trial.user_attrs.get(key):
        return
    study_id = storage.get_study_id_from_name(study)
    storage.set_study_user_attr(study_id, attrs.deleted_key(trial.number, DELETED[key]), why)


def attributes(trial: FrozenTrial, study_attrs: Mapping[str, Any]) -> dict[str, Any]:
    """``trial``'s user attributes as every reader sees them: with ``best_checkpoint_deleted`` and
    ``resume_checkpoint_deleted`` where the study (``study_attrs``, its user attributes) marked them."""
    seen = dict(trial.user_attrs)
    old = _OLD_NOTE.fullmatch(str(seen.get(attrs.BEST_CHECKPOINT, "")))
    if old is not None:
        seen[attrs.BEST_CHECKPOINT] = old["was"]  # None where the old note did not say where it was
        seen[attrs.BEST_CHECKPOINT_DELETED] = old["why"]
    for deleted in DELETED.values():
        why = study_attrs.get(attrs.deleted_key(trial.number, deleted))
        if why is not None:
            seen[deleted] = str(why)
    return seen


def deleted_why(seen: Mapping[str, Any], key: str = attrs.BEST_CHECKPOINT) -> str | None:
    """Why the checkpoint ``key`` names is gone, from attributes ``attributes`` returned; None while it is there."""
    why = seen.get(DELETED[key])
    return None if why is None else str(why)
