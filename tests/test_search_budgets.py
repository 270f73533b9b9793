"""Budgets and queued trials through the real CLI: enqueue first, gpu_hours and timeout stop new trials."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import optuna
import pytest
import torch

from hpsearch.storage import ledger
from hpsearch.storage.open import open_storage
from hpsearch.trainer.evaluate import Metrics, macro_f1
from tests.conftest import spec_text, start_study


def start(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], search: str, n_trials: int
) -> tuple[subprocess.CompletedProcess[str], optuna.Study]:
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=n_trials, search=search))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = start_study("b", spec, url, tmp_path)
    return result, optuna.load_study(study_name="b", storage=url)


def test_enqueued_trial_runs_first_and_gpu_hours_stop_new_trials(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    # 3.6 ms of device time: the first trial uses it up, so none of the other 3 may start.
    result, study = start(
        tmp_path,
        tiny_model,
        demo_files,
        n_trials=4,
        search=("gpu_hours = 0.000001\n[[search.enqueue]]\nlearning_rate = 0.002\n"),
    )
    trials = study.get_trials()
    assert len(trials) == 1, [t.state for t in trials]
    assert trials[0].params == {"learning_rate": 0.002}
    assert trials[0].user_attrs["enqueued"] is True
    assert trials[0].user_attrs["device_seconds"] > 0
    storage = open_storage(f"sqlite:///{tmp_path / 'db.sqlite'}", create=False)
    try:  # the budget's figure is the ledger's, which the trial's attribute copies
        used = ledger.device_time(storage.db, "b")
        assert used.seconds == pytest.approx(trials[0].user_attrs["device_seconds"], abs=1e-3)
        assert set(used.by_unit) == {"CPU-h"}
    finally:
        storage.close()
    assert re.search(r"device time budget used \(0\.\d{3} CPU-h of gpu_hours = 1e-06\)", result.stderr)


def test_timeout_stops_new_trials(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    # A 6 ms timeout runs out while the worker process starts: no trial begins.
    result, study = start(tmp_path, tiny_model, demo_files, n_trials=3, search="timeout_minutes = 0.0001")
    assert study.get_trials() == []
    assert "timeout of 0.0001 minutes reached" in result.stderr


def test_macro_f1_weighs_a_rare_label_like_a_frequent_one() -> None:
    # 90 negatives all right; 10 positives all predicted negative: accuracy 0.9, macro F1 ~0.47.
    confusion = torch.tensor([[90, 0], [10, 0]])
    assert macro_f1(confusion) == pytest.approx((2 * 90 / (90 + 100) + 0.0) / 2)
    assert macro_f1(torch.tensor([[5, 0], [0, 5]])) == 1.0


def test_each_metric_is_searched_in_the_direction_that_makes_it_better(spec_file: Path) -> None:
    """A better model (lower loss, higher accuracy and F1) must be the one the study prefers."""
    from hpsearch.search.study.spec import load_file

    worse, better = Metrics(loss=0.7, accuracy=0.6, f1=0.5), Metrics(loss=0.3, accuracy=0.9, f1=0.8)
    for metric in ("loss", "accuracy", "f1"):
        spec = spec_file.read_text().replace('metric = "loss"', f'metric = "{metric}"')
        assert f'metric = "{metric}"' in spec
        written = spec_file.parent / f"{metric}.toml"
        written.write_text(spec)
        study = optuna.create_study(direction=load_file(written).direction)
        study.add_trial(optuna.trial.create_trial(value=worse.objective(metric)))
        study.add_trial(optuna.trial.create_trial(value=better.objective(metric)))
        assert study.best_trial.number == 1, metric
