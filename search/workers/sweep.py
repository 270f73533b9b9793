"""Sweeping this host's trial folders, at worker start and after every trial, of what no trial will read again.

What killed or reaped attempts leave behind: temp folders of a checkpoint write cut short, finished trials'
resumable state, and a failed attempt's best/ and resume/ once no retry will take them over (retry.py
``take_over``). A running trial's folder is never touched, nor one its retry may still resume from."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.workers import outcome, retry
from hpsearch.storage import attrs
from hpsearch.storage.trialdir import BEST, RESUME, TrialDir

log = logging.getLogger(__name__)


def trial_folders(storage: RDBStorage, study: optuna.Study, root: Path, *, max_retries: int) -> list[Path]:
    """Sweep the trial folders under ``root`` (this host's ``OUTPUT/STUDY``); returns what went."""
    if not root.is_dir():
        return []
    partial = (f".{BEST}.", f".{RESUME}.")  # checkpoint.py's temp and old folders: .best.tmp-*, .resume.old-*
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    retries: dict[int, list[FrozenTrial]] = {}
    for t in trials.values():
        of = t.user_attrs.get(attrs.RETRY_OF)
        if isinstance(of, int):
            retries.setdefault(of, []).append(t)
    gone: list[Path] = []
    for entry in root.iterdir():
        folder = TrialDir.named(root, entry.name)
        trial = trials.get(folder.number) if folder else None
        if folder is None or trial is None or not trial.state.is_finished():
            continue
        if not folder.is_real():
            log.warning("skipping %s: not a folder of %s (a link or a file put in its place)", entry, root)
            continue
        went = [p for p in folder.path.iterdir() if p.name.startswith(partial) and folder.remove(p)]
        # What outcome.py's table says goes of the trial's ending (which finish may not have done on this host).
        released = trial.state == TrialState.FAIL and _released(trial, retries.get(trial.number, []), max_retries)
        state = trial.state.name.lower()
        went += outcome.clear(
            storage, study.study_name, trial, folder, outcome.ending_of(trial), f"trial {state}", released=released
        )
        for path in went:
            log.info("removed %s (trial %d is %s)", path, trial.number, state)
        gone += went
    return gone


def _released(failed: FrozenTrial, its_retries: list[FrozenTrial], max_retries: int) -> bool:
    """Whether no retry will take over the failed attempt's folder any more."""
    if not its_retries:
        # Out of retries. With retries left, hand_back may be about to queue one (it fails
        # the trial first); such a folder waits for the next sweep.
        return retry.out_of_retries(failed, max_retries)
    return all(r.state.is_finished() or not r.user_attrs.get(attrs.RESUME_FROM) for r in its_retries)
