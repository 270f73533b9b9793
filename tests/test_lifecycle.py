"""Lifecycle faults on real processes: a supervisor killed under its workers, orphaned trials,
storage failures inside a trial, broken resumable state, swept folders, budgets and retries."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.storage import attrs, ledger
from tests.conftest import spec_text
from tests.support import deleted
from tests.test_faults import _held_start, _sa_url, _slow_spec, _spawned_workers, _start


def _wait_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (init collects an orphan once it exits, so /proc says so)."""
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
    with _held_start(tmp_path, spec, sqlite_url, 5) as (proc, hold):
        assert _spawned_workers(proc.pid) == [hold.pid]
        _kill_supervisor(proc, hold.pid)  # the kernel's SIGUSR1 reaches the held worker, which stops at step 6
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

    from hpsearch.search.study import studies
    from hpsearch.search.study.spec import load_file
    from hpsearch.storage import slots
    from hpsearch.storage.open import open_storage

    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    spec.write_text(spec.read_text().replace("max_retries = 2", "max_retries = 2\ngpu_hours = 0.5"))
    # What a worker orphaned by its supervisor left: a claimed, bound slot and a RUNNING trial
    # that no registry row names (it died before recording it), an hour old.
    storage = open_storage(sqlite_url, create=True)
    try:
        study = studies.create_or_resume(storage, "f", load_file(spec))
        slot = slots.claim_slot(storage.db, "f", 1, "gone/cpu:0/1")
        assert slot is not None
        trial = study.ask()
        slots.bind_slot(storage.db, "f", slot, trial.number)
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
    # Its hour is not device time: no registry row ever held it, so the ledger has no attempt of it.
    storage = open_storage(sqlite_url, create=False)
    try:
        assert ledger.device_time(storage.db, "f").seconds == 0
    finally:
        storage.close()
    proc = _start(tmp_path, spec, sqlite_url)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "device time budget used" not in err, err[-3000:]
    orphan, retry = _trials(sqlite_url)
    assert orphan.state == TrialState.FAIL and orphan.user_attrs["fail_reason"] == "worker_lost"
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == orphan.number


def _in_process_worker(
    tmp_path: Path, spec: Path, url: str, study: str, n_trials: int = 1, stop: object = None
) -> None:
    """One worker in this process (faults injected with monkeypatch) runs the study to its end."""
    from hpsearch.search.study import studies
    from hpsearch.search.study.spec import load_file
    from hpsearch.search.workers.stop_signals import StopFlag
    from hpsearch.search.workers.worker import Worker, WorkerArgs
    from hpsearch.storage.open import open_storage

    loaded = load_file(spec)
    loaded.search.n_trials = n_trials
    storage = open_storage(url, create=True)
    try:
        studies.create_or_resume(storage, study, loaded)
        runs, checked = str(tmp_path / "runs"), loaded.to_dict()
        args = WorkerArgs(
            study=study, storage_url=url, device="cpu", name="test/cpu:0/1", output_dir=runs, spec=checked
        )
        Worker(args, storage, stop or StopFlag(), None).run()  # type: ignore[arg-type]
    finally:
        storage.close()


def _spec(tmp_path: Path, model: Path, data: tuple[Path, Path], n_trials: int = 1, search: str = "") -> Path:
    """Quick trials (20 steps), no pruning, resumable state at every validation point."""
    spec = tmp_path / "spec.toml"
    text = spec_text(model, *data, n_trials=n_trials, search=search, extra_train="resume_every_minutes = 0")
    spec.write_text(text.replace('pruner = "median"', 'pruner = "none"'))
    return spec


@pytest.mark.parametrize("resume_every_minutes", [0, 60])
def test_a_storage_failure_inside_a_trial_hands_it_back_with_its_checkpoints(
    tmp_path: Path,
    tiny_model: Path,
    demo_files: tuple[Path, Path],
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    resume_every_minutes: int,
) -> None:
    from optuna.exceptions import StorageInternalError

    from hpsearch.search.workers.trial_attrs import TrialReporter

    real_report = TrialReporter.report
    outage = {"left": 1}

    def report(self: TrialReporter, value: float, step: int, metrics: object = None) -> None:
        if step == 10 and outage["left"]:
            outage["left"] -= 1
            time.sleep(2.0)  # the storage layer retrying through the outage
            raise StorageInternalError("An exception is raised during the commit (injected outage)")
        real_report(self, value, step)

    monkeypatch.setattr(TrialReporter, "report", report)
    spec = _spec(tmp_path, tiny_model, demo_files)
    periodic = f"resume_every_minutes = {resume_every_minutes}"
    spec.write_text(spec.read_text().replace("resume_every_minutes = 0", periodic))
    _in_process_worker(tmp_path, spec, sqlite_url, "db")
    first, retry = optuna.load_study(study_name="db", storage=sqlite_url).get_trials()
    assert first.state == TrialState.FAIL, first.user_attrs
    assert first.user_attrs["fail_reason"] == "storage_error (StorageInternalError)"
    # The attempt ends where the storage stopped answering: the outage is not device time.
    wall = (first.datetime_complete - first.datetime_start).total_seconds()
    assert first.user_attrs["device_seconds"] < wall - 1.5, (first.user_attrs["device_seconds"], wall)
    # The retry continued from step 10: the periodic state written there, or (none due for an
    # hour) the one saved when the report failed.
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == first.number
    assert retry.user_attrs["resumed_from_step"] == 10
    assert min(retry.intermediate_values) > 10


def test_a_worker_whose_storage_stays_down_exits_and_the_trial_is_reaped_later(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optuna.exceptions import StorageInternalError

    from hpsearch.search.workers import reap, stop_signals, trial_attrs, worker
    from hpsearch.storage.errors import StorageError
    from hpsearch.storage.open import open_storage

    real_report, real_hand_back = trial_attrs.TrialReporter.report, worker.retry.hand_back

    def report(self: trial_attrs.TrialReporter, value: float, step: int, metrics: object = None) -> None:
        if step == 10:
            raise StorageInternalError("An exception is raised during the commit (injected outage)")
        real_report(self, value, step)

    def hand_back(*args: object, **kwargs: object) -> bool:
        raise StorageError("cannot reach the database (injected outage)")

    monkeypatch.setattr(trial_attrs.TrialReporter, "report", report)
    monkeypatch.setattr(worker.retry, "hand_back", hand_back)
    spec = _spec(tmp_path, tiny_model, demo_files)
    with pytest.raises(stop_signals.StorageLost):
        _in_process_worker(tmp_path, spec, sqlite_url, "db")
    [trial] = optuna.load_study(study_name="db", storage=sqlite_url).get_trials()
    assert trial.state == TrialState.RUNNING, "not failed: nothing could be told"
    assert (tmp_path / "runs" / "db" / "trial-0" / "resume" / "state.pt").exists()
    # The storage is back: the trial is reaped like any lost one and its retry resumes.
    monkeypatch.setattr(trial_attrs.TrialReporter, "report", real_report)
    monkeypatch.setattr(worker.retry, "hand_back", real_hand_back)
    storage = open_storage(sqlite_url, create=False)
    try:
        reaped = reap.reap(storage, "db", max_retries=2, grace_s=0) + reap.retry_orphans(
            storage, "db", max_retries=2, grace_s=0
        )
        assert [r.trial_number for r in reaped] == [0]
    finally:
        storage.close()
    _in_process_worker(tmp_path, spec, sqlite_url, "db")
    first, retry = optuna.load_study(study_name="db", storage=sqlite_url).get_trials()
    assert first.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_from_step"] == 10


class _StopAfter:
    """A stop request (as SIGTERM makes) after ``n`` checks: the worker checks once per step."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> bool:
        self.n -= 1
        return self.n < 0

    def outage_retry_over(self) -> bool:
        return False  # the storage (SQLite) always answers here


def test_a_broken_resumable_state_trains_the_retry_from_the_start(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files)
    _in_process_worker(tmp_path, spec, sqlite_url, "broken", stop=_StopAfter(8))
    state = tmp_path / "runs" / "broken" / "trial-0" / "resume" / "state.pt"
    assert state.stat().st_size > 1000
    with state.open("r+b") as f:
        f.truncate(1000)  # what a full disk or an interrupted copy leaves
    _in_process_worker(tmp_path, spec, sqlite_url, "broken")
    first, retry = optuna.load_study(study_name="broken", storage=sqlite_url).get_trials()
    assert first.user_attrs["fail_reason"] == "interrupted"
    assert retry.state == TrialState.COMPLETE, retry.user_attrs.get("fail_reason")
    assert "resumed_from_step" not in retry.user_attrs
    assert min(retry.intermediate_values) == 5, "trained from the start"
    assert "is damaged or not usable here" in caplog.text and "training from step 0" in caplog.text


class _Killed(BaseException):
    """Stands for SIGKILL: nothing below the worker loop catches it, no clean-up runs."""


def _hand_back_as_supervisor(url: str, study: str, runs: Path) -> None:
    """What the supervisor does when its worker died during trial 0."""
    from hpsearch.search.workers import retry
    from hpsearch.storage.open import open_storage

    storage = open_storage(url, create=False)
    try:
        s = optuna.load_study(study_name=study, storage=storage.optuna)
        [running] = s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        resume = runs / study / f"trial-{running.number}" / "resume" / "state.pt"
        assert retry.hand_back(storage, s, running._trial_id, reason="worker_crash", resume_from=resume, max_retries=2)
    finally:
        storage.close()


def test_a_kill_during_the_first_resumable_save_leaves_no_folder_behind(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpsearch.trainer import checkpoint

    real_save = checkpoint.torch.save

    def killed_while_saving(obj, f, *a, **kw):  # type: ignore[no-untyped-def]
        Path(f).write_bytes(b"half a checkpoint")
        raise _Killed

    spec = _spec(tmp_path, tiny_model, demo_files)
    monkeypatch.setattr(checkpoint.torch, "save", killed_while_saving)
    with pytest.raises(_Killed):
        _in_process_worker(tmp_path, spec, sqlite_url, "kill")
    trial_0 = tmp_path / "runs" / "kill" / "trial-0"
    # Killed at step 5 after its best save, inside its first resumable save.
    assert (trial_0 / "best").is_dir() and list(trial_0.glob(".resume.tmp-*")) and not (trial_0 / "resume").exists()
    _hand_back_as_supervisor(sqlite_url, "kill", tmp_path / "runs")
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    _in_process_worker(tmp_path, spec, sqlite_url, "kill")
    study = optuna.load_study(study_name="kill", storage=sqlite_url)
    first, retry = study.get_trials()
    assert retry.state == TrialState.COMPLETE and "resumed_from_step" not in retry.user_attrs
    assert sorted(p.name for p in trial_0.iterdir() if p.name not in ("train.log", "tensorboard")) == []
    assert first.user_attrs["best_checkpoint"] == str((trial_0 / "best").resolve()), first.user_attrs
    assert deleted.why(study, first.number) == "trial fail", first.user_attrs
    assert Path(retry.user_attrs["best_checkpoint"]).is_dir()


def test_a_reaped_workers_late_resumable_state_is_swept_when_a_worker_starts(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files)
    _in_process_worker(tmp_path, spec, sqlite_url, "late", stop=_StopAfter(8))
    _in_process_worker(tmp_path, spec, sqlite_url, "late")  # the retry resumes and completes
    _, retry = optuna.load_study(study_name="late", storage=sqlite_url).get_trials()
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_from_step"] > 0
    # The reaped attempt's worker wakes up (SIGCONT) and saves once more before it notices.
    late = tmp_path / "runs" / "late" / "trial-0" / "resume"
    late.mkdir()
    (late / "state.pt").write_bytes(b"weights")
    (late.parent / ".best.tmp-0a1b2c3d").mkdir()
    _in_process_worker(tmp_path, spec, sqlite_url, "late")  # budget used: it only tidies
    assert not late.exists() and not list(late.parent.glob(".best.tmp-*"))
    assert (tmp_path / "runs" / "late" / "trial-1" / "best").is_dir()


def _grid_spec(
    tmp_path: Path,
    tiny_model: Path,
    demo_files: tuple[Path, Path],
    n_trials: int,
    choices: str = "1e-3, 2e-3, 3e-3",
    search: str = "",
) -> Path:
    spec = tmp_path / "grid.toml"
    spec.write_text(
        spec_text(
            tiny_model,
            *demo_files,
            n_trials=n_trials,
            search=search,
            space=f'learning_rate = {{ type = "categorical", choices = [{choices}] }}',
        )
        .replace('sampler = "tpe"', 'sampler = "grid"')
        .replace('pruner = "median"', 'pruner = "none"')
        .replace("epochs = 2", "epochs = 1")
    )
    return spec


def test_the_end_of_a_grid_is_no_reaped_trial_and_retention_runs(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _grid_spec(tmp_path, tiny_model, demo_files, n_trials=3, search="keep_top_k = 1")
    _in_process_worker(tmp_path, spec, sqlite_url, "grid", n_trials=3)
    trials = optuna.load_study(study_name="grid", storage=sqlite_url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert sorted(t.params["learning_rate"] for t in trials) == [1e-3, 2e-3, 3e-3]
    assert "reaped" not in caplog.text
    best = min(trials, key=lambda t: t.value)
    kept = sorted(p.parent.name for p in (tmp_path / "runs" / "grid").glob("trial-*/best"))
    assert kept == [f"trial-{best.number}"]


def test_a_resumed_grid_runs_each_point_once(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    # Each worker used to shuffle the grid with its own seed: after a restart, the stored
    # index of a point meant another point, so one ran twice and another never.
    rates = [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]
    spec = _grid_spec(tmp_path, tiny_model, demo_files, n_trials=6, choices=", ".join(map(str, rates)))
    _in_process_worker(tmp_path, spec, sqlite_url, "g", n_trials=1)
    _in_process_worker(tmp_path, spec, sqlite_url, "g", n_trials=6)
    trials = optuna.load_study(study_name="g", storage=sqlite_url).get_trials()
    assert sorted(t.params["learning_rate"] for t in trials) == rates


def test_an_enqueued_trial_that_ends_with_one_grid_point_left_is_no_reaped_trial(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A retry or an enqueued trial has fixed parameters and no grid index; with one point
    # left, optuna's GridSampler looked that index up when it ended (KeyError).
    spec = _grid_spec(tmp_path, tiny_model, demo_files, n_trials=4)
    _in_process_worker(tmp_path, spec, sqlite_url, "q", n_trials=2)
    optuna.load_study(study_name="q", storage=sqlite_url).enqueue_trial({"learning_rate": 1e-3})
    _in_process_worker(tmp_path, spec, sqlite_url, "q", n_trials=4)
    trials = optuna.load_study(study_name="q", storage=sqlite_url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert sorted({t.params["learning_rate"] for t in trials}) == [1e-3, 2e-3, 3e-3]
    assert "reaped" not in caplog.text


def test_a_retry_runs_after_the_timeout_when_its_trial_started_before(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    from hpsearch.search.study import studies
    from hpsearch.search.workers.stop_signals import StopFlag
    from hpsearch.search.workers.worker import Worker, WorkerArgs
    from hpsearch.storage.open import open_storage

    # Two known-good configurations queued first: trial 0 starts, trial 1 waits its turn.
    queued = "timeout_minutes = 60\n" + "[[search.enqueue]]\nlearning_rate = 0.002\n" * 2
    spec = _spec(tmp_path, tiny_model, demo_files, n_trials=3, search=queued)
    _in_process_worker(tmp_path, spec, sqlite_url, "late", n_trials=3, stop=_StopAfter(8))
    storage = open_storage(sqlite_url, create=False)
    try:
        # The timeout runs out while trial 0's retry waits (e.g. its worker crashed).
        study = optuna.load_study(study_name="late", storage=storage.optuna)
        study.set_user_attr(attrs.DEADLINE, storage.db.now() - 1)
        checked = studies.stored_spec(storage, "late").to_dict()
        runs = str(tmp_path / "runs")
        args = WorkerArgs(
            study="late", storage_url=sqlite_url, device="cpu", name="t/cpu:0/1", output_dir=runs, spec=checked
        )
        Worker(args, storage, StopFlag(), None).run()
    finally:
        storage.close()
    first, queued_second, retry = optuna.load_study(study_name="late", storage=sqlite_url).get_trials()
    assert first.state == TrialState.FAIL
    # The retry ran, though the never-started queued trial came before it in optuna's queue:
    # that one would be a new trial, and the timeout holds for those.
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == first.number
    assert queued_second.state == TrialState.WAITING


def test_a_worker_that_starts_deletes_checkpoints_that_fell_out_of_the_top_k_meanwhile(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files, search="keep_top_k = 1")
    _in_process_worker(tmp_path, spec, sqlite_url, "away")
    [ours] = optuna.load_study(study_name="away", storage=sqlite_url).get_trials()
    assert Path(ours.user_attrs["best_checkpoint"]).is_dir()
    # While this host was down, another host finished a better trial.
    study = optuna.load_study(study_name="away", storage=sqlite_url)
    study.add_trial(
        optuna.trial.create_trial(
            params=ours.params,
            distributions=ours.distributions,
            value=ours.value / 2,
            user_attrs={"best_checkpoint": "/host-b/runs/away/trial-1/best"},
        )
    )
    _in_process_worker(tmp_path, spec, sqlite_url, "away")  # budget used: it only tidies
    study = optuna.load_study(study_name="away", storage=sqlite_url)
    gone = tmp_path / "runs" / "away" / "trial-0" / "best"
    assert study.trials[0].user_attrs["best_checkpoint"] == str(gone.resolve())
    assert deleted.why(study, 0) == "not in the study's top 1"
    assert not (tmp_path / "runs" / "away" / "trial-0" / "best").exists()


def test_past_the_deadline_only_a_retry_is_taken_from_the_queue() -> None:
    from hpsearch.search.workers import retry

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    study.enqueue_trial({"x": 1.0})  # a [[search.enqueue]] configuration, never started
    study.enqueue_trial({"x": 2.0}, user_attrs={attrs.RETRY_OF: 0})
    taken = retry.pop_retry(storage, study)
    assert taken is not None and taken.number == 1
    assert retry.pop_retry(storage, study) is None, "no retry left: nothing else may start"
    assert [t.state for t in study.get_trials()] == [TrialState.WAITING, TrialState.RUNNING]


def test_a_worker_s_exit_codes_say_one_thing_each() -> None:
    import signal

    from hpsearch.search.exit_codes import ExitCode

    # The supervisor tells a lost storage from a dead peer rank by the code alone: no two codes
    # are equal, and none is what a signal's end or Python's own error exit reads as.
    codes = [int(c) for c in ExitCode]
    assert len(set(codes)) == len(codes)
    signal_codes = {ExitCode.signalled(s) for s in signal.Signals}
    assert not signal_codes & set(codes) and ExitCode.signalled(signal.SIGINT) == 130
    assert ExitCode.STORAGE_LOST not in (0, 1, 2) and ExitCode.PEER_DIED < 128
