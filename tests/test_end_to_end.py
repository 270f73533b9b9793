"""`hpsearch start` through the real CLI, in subprocesses, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from tests.conftest import hpsearch


def test_start_runs_budget_and_best_checkpoint_predicts(tmp_path: Path, spec_file: Path, storage_url: str) -> None:
    result = hpsearch(
        "start",
        "--study",
        "e2e",
        "--config",
        str(spec_file),
        "--storage",
        storage_url,
        "--devices",
        "cpu:1",
        "--output-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best: trial" in result.stdout

    # A client that knows nothing of hpsearch sees the trials, curves and checkpoint.
    study = optuna.load_study(study_name="e2e", storage=storage_url.replace("postgresql://", "postgresql+psycopg2://"))
    trials = study.get_trials()
    assert len(trials) == 2
    assert {t.state for t in trials} <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert complete, "at least one trial must complete"
    for t in complete:
        # 320 examples / batch 32 = 10 steps per epoch, 2 epochs, eval every 5 steps.
        assert sorted(t.intermediate_values) == [5, 10, 15, 20]
        for key in ("best_checkpoint", "train_samples_per_second", "peak_memory_mb", "device", "host"):
            assert key in t.user_attrs, key
        assert t.value == min(t.intermediate_values.values())

    best = json.loads(hpsearch("best", "--study", "e2e", "--storage", storage_url, "--json", cwd=tmp_path).stdout)
    ckpt = Path(best["best_checkpoint"])
    assert ckpt.is_dir() and ckpt.is_absolute()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForSequenceClassification.from_pretrained(ckpt)
    logits = model(**tok(["the movie was wonderful", "the plot was dull"], return_tensors="pt", padding=True)).logits
    assert logits.shape == (2, 2)
    assert set(model.config.id2label.values()) == {"negative", "positive"}

    status = json.loads(hpsearch("status", "--study", "e2e", "--storage", storage_url, "--json", cwd=tmp_path).stdout)
    assert status["finished"] == 2 and status["best"]["number"] == best["number"]


def test_second_start_adds_only_missing_trials(tmp_path: Path, spec_file: Path) -> None:
    # What is counted is trials, not steps: one epoch each (10 steps, points at 5 and 10) is enough.
    spec_file.write_text(spec_file.read_text().replace("epochs = 2", "epochs = 1"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    common = [
        "--study",
        "grow",
        "--config",
        str(spec_file),
        "--storage",
        url,
        "--devices",
        "cpu:1",
        "--output-dir",
        str(tmp_path / "runs"),
    ]
    assert hpsearch("start", *common, "--n-trials", "1", cwd=tmp_path).returncode == 0
    second = hpsearch("start", *common, "--n-trials", "3", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    third = hpsearch("start", *common, "--n-trials", "3", cwd=tmp_path)
    assert third.returncode == 0
    study = optuna.load_study(study_name="grow", storage=url)
    assert len(study.trials) == 3
    # Nothing left to do: said at once, and no worker is started to find out.
    assert "nothing to run, its budget of 3 trials is used; raise it with --n-trials (more than 3)" in third.stderr
    assert "run here" not in third.stderr
    assert "study grow already has 3 finished trials and n_trials = 3: no new trial will start" in third.stderr
    assert "already has" not in second.stderr
