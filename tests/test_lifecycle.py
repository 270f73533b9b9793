"""Lifecycle faults on real processes: a supervisor killed under its workers, orphaned trials,
storage failures inside a trial, broken resumable state, leftover folders, budgets and retries."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tests.test_faults import _sa_url, _slow_spec, _spawned_workers, _start, _wait_for_report


def _wait_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (an orphan is reaped by init, so /proc says so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _kill_supervisor(proc: object, worker: int, within: float = 20) -> None:
    """SIGKILL the supervisor alone (not its process group) and require its worker to follow."""
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    proc.wait(timeout=30)  # type: ignore[attr-defined]
    alive = not _wait_gone(worker, within)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, f"worker {worker} outlived its SIGKILLed supervisor by {within} s"


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="f", storage=_sa_url(url)).get_trials()


def test_a_supervisor_killed_mid_trial_takes_its_worker_down_and_the_trial_is_retried(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    proc = _start(tmp_path, spec, sqlite_url)
    try:
        _wait_for_report(sqlite_url, min_step=5)
        [worker] = _spawned_workers(proc.pid)
        _kill_supervisor(proc, worker)
    finally:
        proc.kill()
    # The worker took the SIGTERM path: checkpointed and handed its trial back.
    [first, retry] = _trials(sqlite_url)
    assert first.state == TrialState.FAIL and first.user_attrs["fail_reason"] == "interrupted", first.user_attrs
    assert retry.state == TrialState.WAITING and retry.user_attrs["resume_from"]
    again = _start(tmp_path, spec, sqlite_url)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    states = [t.state for t in _trials(sqlite_url)]
    assert states == [TrialState.FAIL, TrialState.COMPLETE], states
    assert _trials(sqlite_url)[1].user_attrs["resumed_from_step"] >= 5


def test_a_supervisor_killed_while_its_worker_loads_leaves_no_running_trial(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    proc = _start(tmp_path, spec, sqlite_url)
    try:
        deadline = time.monotonic() + 120
        while not _spawned_workers(proc.pid):
            assert time.monotonic() < deadline, "no worker was spawned"
            time.sleep(0.05)
        [worker] = _spawned_workers(proc.pid)
        time.sleep(1.0)  # the worker is still importing torch and loading the model
        _kill_supervisor(proc, worker)
    finally:
        proc.kill()
    assert [t for t in _trials(sqlite_url) if t.state == TrialState.RUNNING] == []
    again = _start(tmp_path, spec, sqlite_url)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    complete = [t for t in _trials(sqlite_url) if t.state == TrialState.COMPLETE]
    assert len(complete) == 1, [(t.state, t.user_attrs) for t in _trials(sqlite_url)]


def test_start_fails_and_retries_an_orphaned_running_trial_before_judging_gpu_hours(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    from sqlalchemy import text

    from hpsearch.search import study as studies
    from hpsearch.search.spec import load_file
    from hpsearch.storage import budget
    from hpsearch.storage.open import open_storage

    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    spec.write_text(spec.read_text().replace("max_retries = 2", "max_retries = 2\ngpu_hours = 0.5"))
    # What a worker orphaned by its supervisor left: a claimed, bound slot and a RUNNING trial
    # that no registry row names (it died before recording it), an hour old.
    storage = open_storage(sqlite_url, create=True)
    try:
        study = studies.create_or_resume(storage, "f", load_file(spec))
        slot = budget.claim_slot(storage.db, "f", 1, "gone/cpu:0/1")
        assert slot is not None
        trial = study.ask()
        budget.bind_slot(storage.db, "f", slot, trial.number)
        storage.db.run(
            lambda s: s.execute(text("UPDATE hpsearch_budget_slots SET claimed_at = claimed_at - 3600")),
            what="age the slot",
        )
        storage.db.run(
            lambda s: s.execute(text("UPDATE trials SET datetime_start = datetime(datetime_start, '-1 hour')")),
            what="age the trial",
        )
    finally:
        storage.close()
    assert studies.device_seconds(optuna.load_study(study_name="f", storage=sqlite_url)) > 3000
    proc = _start(tmp_path, spec, sqlite_url)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "device time budget used" not in err, err[-3000:]
    orphan, retry = _trials(sqlite_url)
    assert orphan.state == TrialState.FAIL and orphan.user_attrs["fail_reason"] == "worker_lost"
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == orphan.number
