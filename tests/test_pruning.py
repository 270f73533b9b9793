"""Pruning happens for real: hopeless learning rates are stopped early."""

from __future__ import annotations

from pathlib import Path

import optuna

from tests.conftest import spec_text, start_study


def test_hopeless_trials_are_pruned(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    spec = tmp_path / "prune.toml"
    # Half the space is hopeless: lr 1.0 wrecks the model, so the median pruner stops it.
    spec.write_text(
        spec_text(
            tiny_model,
            *demo_files,
            n_trials=6,
            space='learning_rate = { type = "categorical", choices = [1e-3, 1.0] }',
            search="pruner_warmup_steps = 0",
        )
        .replace('sampler = "tpe"', 'sampler = "random"')
        .replace("epochs = 2", "epochs = 3")
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    start_study("p", spec, url, tmp_path)
    trials = optuna.load_study(study_name="p", storage=url).trials
    assert len(trials) == 6
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [(t.params, t.state, t.intermediate_values) for t in trials]
    # A pruned trial stopped before the last validation point (30 steps) and kept what it reached.
    assert all(max(t.intermediate_values) < 30 for t in pruned)
    assert all("best_checkpoint" in t.user_attrs for t in pruned)
    assert all(t.params["learning_rate"] == 1.0 for t in pruned)
