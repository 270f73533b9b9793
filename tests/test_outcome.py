"""The attempt-outcome table (search/outcome.py), checked on a real SQLite study and real trial folders.

For each outcome: the Optuna state written, whether a retry is queued, what is left of best/ and
resume/ on disk, the fail_reason, and the device time recorded.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search import outcome, study as studies
from hpsearch.search.outcome import Outcome
from hpsearch.search.spec import load_file
from hpsearch.storage import attrs, slots
from hpsearch.storage.open import open_storage
from hpsearch.storage.trialdir import TrialDir

# outcome: (state, retried, best/ left, resume/ left, fail_reason, device_seconds)
EXPECTED = {
    Outcome.COMPLETE: (TrialState.COMPLETE, False, True, False, None, 12.5),
    Outcome.PRUNED: (TrialState.PRUNED, False, False, False, "chance", 12.5),
    Outcome.FAILED: (TrialState.FAIL, False, False, False, "chance", 12.5),
    Outcome.INTERRUPTED: (TrialState.FAIL, True, True, True, "interrupted", 12.5),
    Outcome.STORAGE_LOST: (TrialState.FAIL, True, True, True, "storage_error (chance)", 12.5),
    # Estimated by someone else: written only if the attempt recorded none (2.5 here).
    Outcome.CRASHED: (TrialState.FAIL, True, True, True, "worker_crash (chance)", 2.5),
    Outcome.LOST: (TrialState.FAIL, True, True, True, "worker_lost", 2.5),
    Outcome.NOT_STARTED: (TrialState.FAIL, True, True, True, "not_started", 2.5),
}


@pytest.mark.parametrize("ended", list(Outcome))
def test_finish_does_what_the_table_says(tmp_path: Path, spec_file: Path, sqlite_url: str, ended: Outcome) -> None:
    storage = open_storage(sqlite_url, create=True)
    try:
        study = studies.create_or_resume(storage, "o", load_file(spec_file))
        slot = slots.claim_slot(storage.db, "o", 10, "w")
        trial = study.ask({"learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-3)})
        assert slot is not None
        slots.bind_slot(storage.db, "o", slot, trial.number)
        folder = TrialDir(tmp_path / "runs" / "o", trial.number)
        folder.make()
        folder.best.mkdir()
        folder.resume.mkdir()
        folder.state.write_bytes(b"state")
        trial.set_user_attr(attrs.DEVICE_SECONDS, 2.5)  # an earlier record of this attempt
        trial.set_user_attr("best_checkpoint", str(folder.best))
        trial.set_user_attr(attrs.RESUME_CHECKPOINT, str(folder.state))
        queued = outcome.finish(
            storage, study, trial._trial_id, ended, max_retries=1, folder=folder, detail="chance", value=0.5, spent=10
        )
        state, retried, best, resume, reason, seconds = EXPECTED[ended]
        trials = study.get_trials(deepcopy=False)
        done = trials[trial.number]
        assert done.state == state
        assert queued is retried
        assert [t.user_attrs.get(attrs.RETRY_OF) for t in trials[1:]] == ([trial.number] if retried else [])
        if retried:
            resumes = "" if ended is Outcome.NOT_STARTED else str(folder.state)
            assert trials[1].user_attrs[attrs.RESUME_FROM] == resumes
        assert (folder.best.exists(), folder.resume.exists()) == (best, resume)
        assert done.user_attrs.get(attrs.FAIL_REASON) == reason
        assert done.user_attrs[attrs.DEVICE_SECONDS] == seconds
        note = done.user_attrs["best_checkpoint"]
        assert note == (str(folder.best) if best else f"deleted (trial {ended.value})")
        assert outcome.finish(storage, study, trial._trial_id, Outcome.LOST, max_retries=1) is None, "finished: left"
    finally:
        storage.close()


def test_every_outcome_has_one_row() -> None:
    assert set(outcome.ENDINGS) == set(Outcome)
    assert {o for o, e in outcome.ENDINGS.items() if e.retried} == {
        Outcome.INTERRUPTED,
        Outcome.STORAGE_LOST,
        Outcome.CRASHED,
        Outcome.LOST,
        Outcome.NOT_STARTED,
    }


def test_device_seconds_counts_every_device_and_never_less_than_zero() -> None:
    assert outcome.device_seconds(10.0, 13.0, 2) == 6.0
    assert outcome.device_seconds(13.0, 10.0, 2) == 0.0
