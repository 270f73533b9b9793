"""How an attempt ends (workers/outcome.py), checked through what a user and the next attempt see on a real SQLite
study and real trial folders: the trial's state, whether a retry is queued and what that retry resumes from, what
the leftover sweep removes afterwards (nothing the ending kept wrongly, nothing it should have removed), the reason
`status` shows, and the device time the ledger recorded.
"""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search.study import studies
from hpsearch.search.study.spec import load_file
from hpsearch.search.views import summary
from hpsearch.search.workers import outcome, retry, sweep
from hpsearch.search.workers.outcome import Outcome
from hpsearch.storage import attrs, ledger, registry, slots
from hpsearch.storage.open import open_storage
from hpsearch.storage.trialdir import TrialDir
from hpsearch.trainer.report import FailReason
from tests.support import deleted

# What each ending means for the user, in the words of docs/failures.md.
SUCCEEDED = {Outcome.COMPLETE}
ENDED_FOR_GOOD = {Outcome.COMPLETE, Outcome.PRUNED, Outcome.FAILED}
RESUMES_FROM_ITS_STATE = {
    Outcome.INTERRUPTED,
    Outcome.STORAGE_LOST,
    Outcome.CRASHED,
    Outcome.LOST,
    Outcome.OUT_OF_MEMORY,
}
NOT_COUNTED = {Outcome.OUT_OF_MEMORY}  # a rank's OOM halves the micro-batch: bounded by that, not max_retries
GIVEN_REASON = {Outcome.PRUNED: FailReason.AT_CHANCE, Outcome.FAILED: FailReason.OOM}


@pytest.mark.parametrize("ended", list(Outcome))
def test_an_ending_does_what_its_user_expects(tmp_path: Path, spec_file: Path, sqlite_url: str, ended: Outcome) -> None:
    storage = open_storage(sqlite_url, create=True)
    try:
        study = studies.create_or_resume(storage, "o", load_file(spec_file))
        worker = registry.register(storage.db, "o", "w", "cpu:0+1")  # two devices: device time counts both
        slot = slots.claim_slot(storage.db, "o", 10, "w")
        trial = study.ask({"learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-3)})
        assert slot is not None
        slots.bind_slot(storage.db, "o", slot, trial.number)
        registry.trial_started(storage.db, worker, trial.number)
        root = tmp_path / "runs" / "o"
        folder = TrialDir(root, trial.number)
        folder.make()
        folder.best.mkdir()
        folder.state.parent.mkdir(parents=True, exist_ok=True)
        folder.state.write_bytes(b"state")
        trial.set_user_attr(attrs.BEST_CHECKPOINT, str(folder.best))
        trial.set_user_attr(attrs.RESUME_CHECKPOINT, str(folder.state))
        time.sleep(0.3)
        why_given = GIVEN_REASON.get(ended)
        queued = outcome.finish(
            storage, study, trial._trial_id, ended, max_retries=1, folder=folder, reason=why_given, value=0.5
        )
        done = study.get_trials(deepcopy=False)[trial.number]

        assert done.state == {Outcome.COMPLETE: TrialState.COMPLETE, Outcome.PRUNED: TrialState.PRUNED}.get(
            ended, TrialState.FAIL
        )
        assert queued is (ended not in ENDED_FOR_GOOD)
        # Only a complete trial competes for a kept best model; a resumable state outlives only a handed-back trial.
        assert folder.best.exists() is (ended not in ENDED_FOR_GOOD - SUCCEEDED)
        assert folder.resume.exists() is (ended not in ENDED_FOR_GOOD)
        # The paths stay as they were; a deleted folder is marked, with the ending that removed it.
        assert done.user_attrs[attrs.BEST_CHECKPOINT] == str(folder.best)
        assert done.user_attrs[attrs.RESUME_CHECKPOINT] == str(folder.state)
        gone = f"trial {ended.name.lower()}"
        assert deleted.why(study, trial.number) == (gone if ended in ENDED_FOR_GOOD - SUCCEEDED else None)
        assert deleted.why(study, trial.number, "resume_checkpoint_deleted") == (
            gone if ended in ENDED_FOR_GOOD else None
        )

        # The reason `status` shows, named once (FailReason) with its text.
        recorded = done.user_attrs.get(attrs.FAIL_REASON)
        why = FailReason.of(recorded)
        assert (why is None) is (ended is Outcome.COMPLETE)
        if why is not None:
            assert summary.reason(summary.trial_dict(done, study.user_attrs)) in (recorded, why.text)

        # Device time: the ledger's figure for this attempt (two devices, >= 0.3 s each), copied onto the trial.
        seconds = done.user_attrs[attrs.DEVICE_SECONDS]
        assert seconds == pytest.approx(ledger.device_time(storage.db, "o").seconds, abs=1e-3) and seconds >= 0.6

        # The sweep reads the same table: it keeps a complete trial's best model and what a retry resumes from,
        # and removes what no attempt will read again (a trial handed back before it began resumes from nothing).
        sweep.trial_folders(storage.optuna, study, root, max_retries=1)
        assert folder.best.exists() is (ended in SUCCEEDED | RESUMES_FROM_ITS_STATE)
        assert folder.resume.exists() is (ended in RESUMES_FROM_ITS_STATE)

        if queued:
            [waiting] = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            again = retry.pop_retry(storage.optuna, study)
            assert again is not None and waiting.number == again.number
            assert waiting.user_attrs[attrs.RETRY_COUNT] == (0 if ended in NOT_COUNTED else 1)
            resumes = retry.take_over(storage, "o", again, TrialDir(root, again.number))
            assert (resumes is not None) is (ended in RESUMES_FROM_ITS_STATE)
        assert outcome.finish(storage, study, trial._trial_id, Outcome.LOST, max_retries=1) is None, "finished: left"
    finally:
        storage.close()


def test_a_finished_trial_reads_back_its_ending() -> None:
    """The sweep finds a finished trial's row of the table from its state and recorded reason."""
    for ending in outcome.ENDINGS.values():
        if ending.state == TrialState.COMPLETE or ending.state == TrialState.PRUNED:
            continue
        trial = optuna.trial.create_trial(state=TrialState.FAIL)
        reason = ending.reason or FailReason.OOM
        trial.set_user_attr(attrs.FAIL_REASON, reason.record("a detail"))
        assert outcome.ending_of(trial) is ending or (ending.reason is None and not outcome.ending_of(trial).retried)
