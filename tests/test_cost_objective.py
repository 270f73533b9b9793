"""Cost as a second objective and money (issue 41, parts 2 and 3): a two-objective study pruned on its quality
objective, its Pareto front shown and kept, and money that is the ledger's device time x the price."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search.study import objectives, studies
from hpsearch.search.views import note, progress
from hpsearch.search.workers.trial_attrs import TrialReporter
from hpsearch.search.workers.worker import candidates
from hpsearch.storage import attrs, ledger, retention
from hpsearch.storage.open import open_storage
from hpsearch.storage.trialdir import TrialDir
from tests.conftest import Cli, assert_refused, hpsearch, one_trial, spec_text, start_study
from tests.support import deleted

MONEY = 'price_per_gpu_hour = 1.98\ncurrency = "CNY"\n'


def test_a_two_objective_search_prunes_on_quality_shows_its_front_and_its_cost(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "cost.toml"
    # Half the space is hopeless (lr 1.0 wrecks the model): the median pruner stops it on the validation loss.
    spec.write_text(
        spec_text(
            tiny_model,
            *demo_files,
            n_trials=6,
            space='learning_rate = { type = "categorical", choices = [1e-3, 1.0] }',
            search=MONEY + "keep_top_k = 2",
        )
        .replace('sampler = "tpe"', 'sampler = "random"')
        .replace('metric = "loss"', 'metric = ["loss", "gpu_hours"]')
        .replace("epochs = 2", "epochs = 3")
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = start_study("c", spec, url, tmp_path)
    study = optuna.load_study(study_name="c", storage=url)
    assert [d.name for d in study.directions] == ["MINIMIZE", "MINIMIZE"]
    assert study.metric_names == ["val_loss", "gpu_hours"]  # the dashboard's axes
    trials = study.get_trials()
    assert len(trials) == 6
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned, [(t.params, t.state, t.user_attrs.get(attrs.POINTS)) for t in trials]
    # Pruned on the quality objective before the last point (30 steps), its points kept where the dashboard shows them.
    assert all(t.params["learning_rate"] == 1.0 for t in pruned)
    assert all(max(objectives.points(t)) < 30 for t in pruned)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete
    storage = open_storage(url, create=False)
    try:
        each = ledger.by_trial(storage.db, "c")
        device_time = ledger.device_time(storage.db, "c")
        used = device_time.seconds
        spent = storage.db.run(lambda s: ledger.spent(s, storage.db, "c"), what="read the ledger")
        stored = studies.stored_spec(storage, "c")
        # The dashboard's note and the live display read a two-objective study too.
        assert "loss (minimize) and gpu_hours (minimize)" in note.render(study, stored, 6, device_time)
        best_quality = min(t.values[0] for t in study.best_trials)
        assert progress.read(study, stored, device_time).best_value == best_quality
    finally:
        storage.close()
    for t in complete:
        assert len(t.values) == 2 and t.values[0] == min(objectives.points(t).values())
        assert t.values[1] == pytest.approx(t.user_attrs[attrs.DEVICE_SECONDS] / 3600, abs=1e-6)  # the ledger's
    # Retention keeps the front first, up to keep_top_k.
    front = {t.number for t in study.best_trials}
    ranked = sorted(complete, key=lambda t: (t.number not in front, t.values[0], t.number))
    kept = {t.number for t in complete if TrialDir(tmp_path / "runs" / "c", t.number).best.exists()}
    assert kept == {t.number for t in ranked[:2]}
    # The end-of-search summary, status and best say what the study cost; best prints the front. (status and
    # best in-process: what they print is the test, not their process; `start` above is the real one.)
    assert "spent: " in result.stdout and " CNY so far" in result.stdout
    best = cli("best", "--study", "c", "--storage", url, cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    assert "pareto front (loss and gpu_hours)" in best.stdout
    for number in front:
        assert f"  trial {number}  loss " in best.stdout
    shown = json.loads(cli("best", "--study", "c", "--storage", url, "--json", cwd=tmp_path).stdout)
    assert sorted(t["number"] for t in shown["pareto_front"]) == sorted(front)
    # Money = the ledger's device time x the price, exactly: the study's and each trial's.
    assert shown["study_money"]["spent"] == used / 3600 * 1.98
    for t in shown["pareto_front"]:
        assert t["money"] == sum(x.seconds for x in spent if x.trial_number == t["number"]) / 3600 * 1.98
        assert t["money"] == each[t["number"]] / 3600 * 1.98
    status = cli("status", "--study", "c", "--storage", url, "--json", cwd=tmp_path)
    s = json.loads(status.stdout)
    assert s["money"]["spent"] == used / 3600 * 1.98 and s["money"]["currency"] == "CNY"
    assert all(t["money"] == each.get(t["number"], 0.0) / 3600 * 1.98 for t in s["trials"])
    assert "CNY" in cli("status", "--study", "c", "--storage", url, cwd=tmp_path).stdout


def test_the_pruner_judges_a_two_objective_trial_on_its_quality_objective(storage_url: str) -> None:
    """Optuna's own report and should_prune refuse a two-objective study; the reporter's view asks the pruner."""
    storage = open_storage(storage_url, create=True)
    try:
        pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
        study = optuna.create_study(
            study_name="v", storage=storage.optuna, directions=["maximize", "minimize"], pruner=pruner
        )
        good = study.ask()
        TrialReporter(good, storage.optuna).report(0.9, 5)
        study.tell(good, [0.9, 0.1])
        bad = study.ask()
        with pytest.raises(NotImplementedError):
            bad.report(0.1, 5)
        reporter = TrialReporter(bad, storage.optuna)
        reporter.report(0.2, 5)
        reporter.report(0.95, 5)  # a step's first report stands, as in Optuna
        assert reporter.should_prune()  # 0.2 < the median 0.9: maximised accuracy
        assert objectives.points(study.trials[1]) == {5: 0.2}
        study.tell(bad, state=TrialState.PRUNED)
        assert study.trials[1].values is None and study.trials[1].intermediate_values == {}
        # TPE ranks a pruned trial's intermediate values by study.direction, which a two-objective study refuses.
        study.sampler = optuna.samplers.TPESampler(n_startup_trials=1, seed=0)
        study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        better = study.ask()
        reporter = TrialReporter(better, storage.optuna)
        reporter.report(0.95, 5)
        assert not reporter.should_prune()
        # Successive halving and hyperband judge through the same view (hyperband builds its own bracket studies).
        for kind in (optuna.pruners.SuccessiveHalvingPruner(min_resource=5), optuna.pruners.HyperbandPruner(5, 30)):
            study.pruner = kind
            assert isinstance(TrialReporter(study.ask(), storage.optuna).should_prune(), bool)
    finally:
        storage.close()


def test_retention_keeps_the_front_before_a_better_trial_off_it(tmp_path: Path) -> None:
    """Off the front, a trial of better quality than a front trial (dominated by another) ranks after the front."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = optuna.create_study(study_name="r", storage=url, directions=["maximize", "minimize"])
    root = tmp_path / "runs" / "r"
    # 0 dominates 1 (better accuracy, cheaper); 2 is the cheapest: the front is {0, 2}.
    for number, values in enumerate([[0.9, 1.0], [0.8, 2.0], [0.7, 0.5]]):
        folder = TrialDir(root, number)
        folder.make()
        folder.best.mkdir()
        (folder.best / "model.safetensors").write_bytes(b"x")
        user_attrs = {attrs.BEST_CHECKPOINT: str(folder.best)}
        study.add_trial(optuna.trial.create_trial(values=values, user_attrs=user_attrs))
    storage = open_storage(url, create=False)
    try:
        retention.retain(storage.optuna, "r", candidates(study, root), keep_top_k=2, minimize=False)
    finally:
        storage.close()
    assert [TrialDir(root, n).best.exists() for n in range(3)] == [True, False, True]
    study = optuna.load_study(study_name="r", storage=url)
    assert study.trials[1].user_attrs[attrs.BEST_CHECKPOINT] == str(TrialDir(root, 1).best)
    assert deleted.why(study, 1) == "not in the study's top 2"


@pytest.mark.parametrize(
    "search, expected",
    [
        ('metric = ["accuracy", "gpu_minutes"]', "the second objective must be one of gpu_hours"),
        ('metric = ["accuracy", "gpu_hours", "peak_memory_gb"]', "must be one objective"),
        ('metric = ["gpu_hours", "accuracy"]', "the first objective must be one of loss, accuracy, f1"),
        ("price_per_gpu_hour = -1.98", "search.price_per_gpu_hour: -1.98 must be a finite number >= 0"),
        ("budget = 10.0", "search.budget: 10.0 is money and needs a price"),
        ('currency = "Chinese yuan"', "search.currency"),
    ],
)
def test_bad_objectives_and_money_are_refused_in_one_line(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], search: str, expected: str
) -> None:
    text = spec_text(tiny_model, *demo_files)
    if search.startswith("metric"):
        text = text.replace('metric = "loss"', search)
    else:
        text = text.replace("seed = 0", f"seed = 0\n{search}")
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    assert_refused(cli, spec, tmp_path, expected)


def test_a_sampler_of_one_objective_is_refused_for_two(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    text = spec_text(tiny_model, *demo_files).replace('metric = "loss"', 'metric = ["loss", "gpu_hours"]')
    spec = tmp_path / "cmaes.toml"
    spec.write_text(text.replace('sampler = "tpe"', 'sampler = "cmaes"'))
    assert_refused(cli, spec, tmp_path, "search.sampler: 'cmaes' cannot search two objectives")


def test_a_money_budget_stops_new_trials(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], storage_url: str
) -> None:
    # 1e-6 yuan at 1.98 an hour: 1.8 ms of device time, used up by the first trial.
    spec = tmp_path / "budget.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=3, search=MONEY + "budget = 0.000001"))
    result = start_study("m", spec, storage_url, tmp_path)
    assert "money budget used" in result.stderr and "of 1e-06 CNY" in result.stderr
    shown = json.loads(hpsearch("status", "--study", "m", "--storage", storage_url, "--json", cwd=tmp_path).stdout)
    storage = open_storage(storage_url, create=False)
    try:  # the study's money is the ledger's device time x the price, exactly, by either database's clock
        (trial,) = optuna.load_study(study_name="m", storage=storage.optuna).trials
        assert shown["money"]["spent"] == ledger.device_time(storage.db, "m").seconds / 3600 * 1.98 >= 0.000001
        assert shown["trials"][0]["money"] == ledger.by_trial(storage.db, "m")[trial.number] / 3600 * 1.98
    finally:
        storage.close()


@pytest.mark.parametrize(
    "cost, recorded, scale", [("trainable_parameters", attrs.TRAINABLE, 1), ("peak_memory_gb", attrs.PEAK_MEMORY, 1024)]
)
def test_the_cost_objective_is_what_the_trainer_measured(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], cost: str, recorded: str, scale: int
) -> None:
    spec = tmp_path / "cost.toml"
    text = spec_text(tiny_model, *demo_files, n_trials=1).replace("epochs = 2", "epochs = 1")
    spec.write_text(text.replace('metric = "loss"', f'metric = ["accuracy", "{cost}"]'))
    trial = one_trial("t", spec, f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path)
    assert trial.values[1] == trial.user_attrs[recorded] / scale > 0
    assert trial.values[0] == max(objectives.points(trial).values())
