"""What a trial's attributes say of its checkpoints, read as hpsearch reads them (storage/deletions.py)."""

from __future__ import annotations

from typing import Any

import optuna


def seen(study: optuna.Study, number: int) -> dict[str, Any]:
    """Trial ``number``'s user attributes with ``best_checkpoint_deleted`` / ``resume_checkpoint_deleted``."""
    from hpsearch.storage import deletions

    return deletions.attributes(study.trials[number], study.user_attrs)


def why(study: optuna.Study, number: int, key: str = "best_checkpoint_deleted") -> str | None:
    """Why trial ``number``'s checkpoint (``key``) was deleted; None while it is there."""
    return seen(study, number).get(key)
