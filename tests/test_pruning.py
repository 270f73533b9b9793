"""Pruning happens for real: hopeless learning rates are stopped early."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from hpsearch.search.workers.early_stop import EarlyStop, PruningGate
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import fit
from hpsearch.trainer.model import load_tokenizer
from tests.conftest import spec_text, start_study
from tests.support.tiny import tiny_run


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


class _AlwaysPrune(NullReporter):
    def should_prune(self) -> bool:
        return True


@pytest.mark.parametrize("wait,warmup_ratio,stopped_at", [(True, 0.3, 6), (False, 0.3, 2), (True, 0.0, 2)])
def test_the_pruner_is_asked_only_after_the_trials_warmup(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path, wait: bool, warmup_ratio: float, stopped_at: int
) -> None:
    # 320 examples, batch 32, 2 epochs: 20 steps; warm-up 0.3 = 6 steps; a validation point every 2.
    tok = load_tokenizer(str(tiny_model))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    cfg = TrainConfig(batch_size=32, micro_batch_size=32, epochs=2, eval_every=2, warmup_ratio=warmup_ratio)
    # The search's gate around the trial's pruner, as a worker sets it up.
    gate = PruningGate.of_run(data, cfg, "loss", prune_at_chance=0, patient=wait)
    reporter = _AlwaysPrune()
    result = fit(tiny_run(tiny_model, (tok, data), cfg, tmp_path), EarlyStop(reporter, gate))
    assert (result.status, result.steps) == ("pruned", stopped_at)
    # Reported at every point all the same: the curve is whole in the study.
    assert sorted(reporter.values) == list(range(2, stopped_at + 1, 2))


@pytest.mark.parametrize("wait", [True, False])
def test_asha_judges_a_warming_up_trial_once_its_warmup_ended(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], wait: bool
) -> None:
    # Trial 1's learning rate wrecks the model, so asha prunes it at its first judged point:
    # step 5 (the first rung) when the pruner does not wait, else step 15, the first point
    # after its 12 warm-up steps (0.6 of 20).
    spec = tmp_path / "wait.toml"
    enqueue = (
        "[[search.enqueue]]\nlearning_rate = 1e-3\nwarmup_ratio = 0.0\n"
        "[[search.enqueue]]\nlearning_rate = 0.5\nwarmup_ratio = 0.6\n[search.space]"
    )
    spec.write_text(
        spec_text(
            tiny_model,
            *demo_files,
            n_trials=2,
            space='learning_rate = { type = "float", low = 1e-4, high = 1.0, log = true }\n'
            'warmup_ratio = { type = "float", low = 0.0, high = 0.6 }',
            search=f"patient_pruning = {'true' if wait else 'false'}",
        )
        .replace('pruner = "median"', 'pruner = "asha"')
        .replace("[search.space]", enqueue)
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    start_study("w", spec, url, tmp_path)
    first, second = optuna.load_study(study_name="w", storage=url).trials
    assert first.state == optuna.trial.TrialState.COMPLETE
    assert second.state == optuna.trial.TrialState.PRUNED, second.intermediate_values
    assert max(second.intermediate_values) == (15 if wait else 5)
