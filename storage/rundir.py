"""Which study a checkpoint folder belongs to: two studies of one name (two storages, or a database deleted and
started again) would write the same ``OUTPUT/S/trial-n`` folders, overwriting the first one's checkpoints. So the
first study to use ``OUTPUT/S`` leaves a marker naming itself (its random id), which every start, worker and export
checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpsearch.storage import regular
from hpsearch.storage.errors import StudyFolderError
from hpsearch.storage.shown import shown

MARKER = ".hpsearch-study.json"
MAX_MARKER_BYTES = 2**16  # a marker is three short strings
URL_LIMIT = 400
"""Characters of a marker's storage URL shown: a deep temporary path fits, a forged page does not."""


def owner(study_dir: Path) -> dict[str, str] | None:
    """The marker's contents (``uid``, ``study``, ``storage``), or None where there is none."""
    try:
        data = json.loads(regular.read_text(study_dir / MARKER, MAX_MARKER_BYTES))
    except (FileNotFoundError, NotADirectoryError):  # a file where the folder goes: --output-dir's check says so
        return None
    except (OSError, ValueError):
        data = None  # unreadable (a FIFO, a link put there among them): owned by nobody we know
    return data if isinstance(data, dict) else {"uid": "", "study": "?", "storage": "?"}


def check(study_dir: Path, study: str, uid: str | None, *, exists: bool, storage: str = "") -> None:
    """Refuse a folder that another study's trials wrote, before anything is written. ``uid`` is the study's id
    (None for a new study, or one older than ids); ``exists``: the study is in the storage already; ``storage``
    (masked) is where it lives, to tell an earlier study of the same storage from another's."""
    if study_dir.is_symlink():
        # Retention deletes trial-N/best inside it: through a link, that would be outside the runs folder.
        raise StudyFolderError(
            f"{study_dir} is a link (to {shown(os.readlink(study_dir))}); hpsearch writes a study's checkpoints only "
            "into a real folder: remove the link, or pass the folder it points into as --output-dir"
        )
    marker = owner(study_dir)
    if marker is not None:
        if uid is None or marker.get("uid") != uid:
            # The marker is a file in a shared folder: what it says is printed escaped and bounded (a URL of a long
            # path stays whole; a megabyte does not).
            owner_storage = shown(marker.get("storage", "?"), URL_LIMIT)
            if marker.get("storage") == storage:
                owner_storage = f"{storage}, since deleted or created again"
            raise StudyFolderError(_taken(study_dir, study, owner_storage))
        return
    # No marker: a folder from before markers existed. A study that already has trials may
    # have written it; a new one cannot have.
    if not exists and any(study_dir.glob("trial-*")):
        raise StudyFolderError(_taken(study_dir, study, "a study that no longer exists, or another storage"))


def claim(study_dir: Path, study: str, uid: str, storage: str) -> None:
    """Mark ``study_dir`` as the study's (after :func:`check` passed); idempotent."""
    if owner(study_dir) is not None:
        return
    regular.check_unmoved(study_dir / MARKER)
    study_dir.mkdir(parents=True, exist_ok=True)
    tmp = study_dir / f"{MARKER}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)  # left by a start of this pid that died here; never written through
    with regular.create_new(tmp, 0o644) as f:
        f.write(json.dumps({"uid": uid, "study": study, "storage": storage}, indent=2) + "\n")
    os.replace(tmp, study_dir / MARKER)  # atomic: a reader sees no marker or a whole one


def _taken(study_dir: Path, study: str, storage: str) -> str:
    return (
        f"{study_dir} holds the checkpoints of another study named {study!r} (from {storage}); "
        "pass another --output-dir or study name, or move that folder away"
    )
