"""One figure each for device time and for the failed count: the gpu_hours budget, the live line, `status`, the
money line and the study note read the same ledger sum, shown by device kind in the same units, and count the same
failed trials, on a real study (SQLite and PostgreSQL)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import tomllib

from hpsearch.search.study import budget
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.views import note, progress, status_text, summary
from hpsearch.storage import attrs, ledger, registry
from hpsearch.storage.open import Storage, open_storage
from hpsearch.storage.tables import Attempt
from tests.conftest import spec_text

HOUR = 3600.0


def _spec(**search: object) -> StudySpec:
    where = Path("/nonexistent")
    raw = tomllib.loads(spec_text(where / "model", where / "t.jsonl", where / "d.jsonl"))
    raw["search"].update(search)
    return StudySpec.from_dict(raw, base_dir=where)


def _attempt(storage: Storage, worker: int, trial: int, devices: int, hours: float) -> None:
    def add(s: object) -> None:
        s.add(  # type: ignore[attr-defined]
            Attempt(
                study_name="one", trial_number=trial, worker_id=worker, devices=devices, started_at=0.0, ended_at=hours
            )
        )

    storage.db.run(add, what="add an attempt")


@pytest.fixture
def study(storage_url: str) -> tuple[Storage, optuna.Study]:
    """Trial 0 failed and was handed back; its retry, trial 1, failed for good; trial 2 completed. A GPU pair
    worked 1 hour (2 device-hours) on trial 0, a CPU 0.5 hours on trial 1. The old code said "2.50 CPU-h" on a CPU
    host's live line, "GPU-hours 2.000 (all devices 2.500 h)" in status, and 2 failed in status and the note."""
    storage = open_storage(storage_url, create=True)
    storage.prepare()
    study = optuna.create_study(study_name="one", storage=storage.optuna)
    handed_back = study.ask()
    study.tell(handed_back, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial({}, user_attrs={attrs.RETRY_OF: handed_back.number})
    broken = study.ask()  # pops the queued retry: the retry runs as trial 1
    assert broken.number == 1
    study.tell(broken, state=optuna.trial.TrialState.FAIL)
    study.tell(study.ask(), 0.5)
    gpu = registry.register(storage.db, "one", "w-gpu", "cuda:0+1", host="h", pid=1)
    cpu = registry.register(storage.db, "one", "w-cpu", "cpu:0", host="h", pid=2)
    _attempt(storage, gpu, 0, 2, HOUR)
    _attempt(storage, cpu, 1, 1, HOUR / 2)
    yield storage, study
    storage.close()


def test_device_time_and_failed_trials_are_one_figure_in_every_view(study: tuple[Storage, optuna.Study]) -> None:
    storage, s = study
    used = ledger.device_time(storage.db, "one")
    assert used.by_unit == {"GPU-h": pytest.approx(2 * HOUR), "CPU-h": pytest.approx(HOUR / 2)}
    assert used.seconds == pytest.approx(2.5 * HOUR)
    shown = "2.00 GPU-h + 0.50 CPU-h"

    # The budget counts every kind (2.5 device-hours), and says which they were.
    spec = _spec(gpu_hours=2.5, price_per_gpu_hour=2.0, currency="USD")
    said = budget.budget_left(storage, s, spec, now=0.0)
    assert said == "device time budget used (2.000 GPU-h + 0.500 CPU-h of gpu_hours = 2.5)"
    assert budget.budget_left(storage, s, replace(spec, search=replace(spec.search, gpu_hours=2.6)), now=0.0) is None

    # The live line: the same units, whatever device this host has; the failed trial handed back is not failed.
    snap = progress.read(s, spec, used)
    line = progress.Progress("one", storage.url, spec).line(snap)
    assert f"{shown} used" in line and "1 failed" in line, line

    # status: the workers' line and rows, the trials line and the money line.
    st = summary.status(s, spec, 4, storage.display)
    st.update(summary.workers(storage.db, "one"))
    summary.add_money(storage.db, "one", spec, st)
    workers = status_text.format_workers(st)
    assert "2.000 GPU-h + 0.500 CPU-h" in workers.splitlines()[0], workers
    rows = {line.split()[2]: line for line in workers.splitlines()[1:]}  # by device
    assert rows["cuda:0+1"].endswith("2.000 GPU-h") and rows["cpu:0"].endswith("0.500 CPU-h"), workers
    assert st["device_hours"] == {"GPU-h": pytest.approx(2.0), "CPU-h": pytest.approx(0.5)}
    text = status_text.format_status(st)
    assert "failed 1 " in text, text
    assert "spent: 5.00 USD so far (2.0000 GPU-h + 0.5000 CPU-h at 2.00 USD a device-hour)" in text, text
    assert st["failed"] == [1] and summary.failed(s.get_trials()) == [s.trials[1]]

    # The study note.
    body = note.render(s, spec, 4, used)
    assert f"1 failed; {shown} used." in body, body


def test_a_study_on_cpus_only_is_counted_in_cpu_hours_and_one_that_did_nothing_in_neither() -> None:
    assert ledger.DeviceTime({"CPU-h": 90.0}).text(3) == "0.025 CPU-h"
    assert ledger.DeviceTime().text() == "0.00 device-h"
    assert [ledger.unit(d) for d in ("cuda:0", "cuda:0+1", "cpu:0", "cpu")] == ["GPU-h", "GPU-h", "CPU-h", "CPU-h"]
