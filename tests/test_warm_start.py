"""Warm start ([search] warm_start): a new study runs an earlier study's best configurations first, gives TPE its
results, leaves out what does not fit its space with a line each, does it once, and refuses bad input with one line.

The earlier studies are real: trained through the CLI with the tiny model, in SQLite and in the real PostgreSQL."""

from __future__ import annotations

import multiprocessing
from contextlib import closing
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hpsearch.search.study import warm_start
from hpsearch.storage import attrs, urls
from hpsearch.storage.open import open_storage
from tests.conftest import Cli, hpsearch, spec_text, start_study

# The earlier study runs these three, fixed, so the test knows which fit the new space: 3e-3 is above its range.
EARLIER = """
[[search.enqueue]]
learning_rate = 1e-4
warmup_ratio = 0.0
[[search.enqueue]]
learning_rate = 1e-3
warmup_ratio = 0.1
[[search.enqueue]]
learning_rate = 3e-3
warmup_ratio = 0.2
[search.space]"""
EARLIER_SPACE = (
    'learning_rate = { type = "float", low = 1e-5, high = 5e-3, log = true }\n'
    'warmup_ratio = { type = "float", low = 0.0, high = 0.3 }'
)
# The new study: a narrower learning rate, no warmup_ratio, and weight_decay, which the earlier study fixed at 0.
NEW_SPACE = (
    'learning_rate = { type = "float", low = 5e-5, high = 2e-3, log = true }\n'
    'weight_decay = { type = "float", low = 0.0, high = 0.1 }'
)


def _spec(path: Path, files: tuple[Path, Path], tiny_model: Path, *, n_trials: int, space: str, search: str) -> Path:
    # One epoch (10 steps, points at 5 and 10): what is warm-started is which configurations run and which values
    # are copied, whatever they are; the ten trials of the first test need not train longer.
    text = spec_text(tiny_model, *files, n_trials=n_trials, space=space, search=search)
    path.write_text(text.replace("epochs = 2", "epochs = 1"))
    return path


def _earlier(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], url: str) -> optuna.Study:
    """The earlier study "small", three trials trained through the CLI in ``url``."""
    spec = _spec(tmp_path / "small.toml", demo_files, tiny_model, n_trials=3, space=EARLIER_SPACE, search="")
    # No pruner: the test needs all three finished, whatever the tiny model's curve at 3e-3 does.
    text = spec.read_text().replace("[search.space]", EARLIER).replace('pruner = "median"', 'pruner = "none"')
    spec.write_text(text)
    start_study("small", spec, url, tmp_path)
    study = optuna.load_study(study_name="small", storage=urls.normalize(url))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    return study


def test_a_warm_start_from_another_storage_queues_the_best_configurations_once_and_gives_tpe_the_results(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    earlier = _earlier(tmp_path, tiny_model, demo_files, pg_url)
    by_lr = {t.params["learning_rate"]: t for t in earlier.trials}
    url = f"sqlite:///{tmp_path / 'big.db'}"
    # n_trials = 6: the best min(5, 6 // 3) = 2 run first. The earlier trials ran with weight_decay 0 (fixed).
    search = f'warm_start = "{pg_url}#small"'  # spec_text's sampler is tpe
    spec = _spec(tmp_path / "big.toml", demo_files, tiny_model, n_trials=6, space=NEW_SPACE, search=search)
    args = ("start", "--study", "big", "--config", str(spec), "--storage", url, "--devices", "cpu:1")
    first = hpsearch(*args, "--output-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    said = [line for line in first.stderr.splitlines() if "warm start" in line]
    assert any("parameter warmup_ratio of" in line and "not a parameter of this study" in line for line in said), said
    assert any("parameter learning_rate of" in line and "0.003 is outside the search range" in line for line in said)
    study = optuna.load_study(study_name="big", storage=url)
    trials = study.get_trials(deepcopy=False)
    # Best first, by the earlier study's own values (loss: lowest); the 3e-3 trial keeps only its weight_decay.
    best_two = sorted(earlier.trials, key=lambda t: t.value)[:2]
    expected = [
        {"weight_decay": 0.0, **({"learning_rate": lr} if lr <= 2e-3 else {})}
        for lr in (t.params["learning_rate"] for t in best_two)
    ]
    queued = sorted((t for t in trials if t.user_attrs.get(attrs.WARM_START_OF)), key=lambda t: t.number)
    assert [t.system_attrs["fixed_params"] for t in queued] == expected
    assert [t.user_attrs[attrs.WARM_START_OF].rsplit("#", 1)[1] for t in queued] == [str(t.number) for t in best_two]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs.get(attrs.BEST_CHECKPOINT) for t in queued)

    # TPE's history: the two earlier trials whose every parameter fits, with their values, copied as COMPLETE.
    results = [t for t in trials if t.user_attrs.get(attrs.EARLIER_RESULT)]
    assert sorted((t.params["learning_rate"], t.value) for t in results) == [
        (lr, by_lr[lr].value) for lr in (1e-4, 1e-3)
    ]
    assert all(t.params["weight_decay"] == 0.0 and not t.user_attrs.get(attrs.BEST_CHECKPOINT) for t in results)
    assert study.user_attrs[attrs.WARM_START]["results"] == 2
    # They never ran here: not counted, never the best.
    assert len(warm_start.ran_here(trials)) == 6
    status = hpsearch("status", "--study", "big", "--storage", url, "--json", cwd=tmp_path)
    assert '"finished": 6' in status.stdout, status.stdout[:2000]

    # A resume (a second start, more trials) does not apply the warm start again.
    again = hpsearch(*args, "--n-trials", "7", "--output-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "warm start" not in again.stderr
    trials = optuna.load_study(study_name="big", storage=url).get_trials(deepcopy=False)
    assert sum(bool(t.user_attrs.get(attrs.WARM_START_OF)) for t in trials) == 2
    assert sum(bool(t.user_attrs.get(attrs.EARLIER_RESULT)) for t in trials) == 2
    assert len(warm_start.ran_here(trials)) == 7


def test_a_two_objective_study_is_warm_started_by_its_quality_objective_and_given_no_results(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    # A single-objective study seeds a two-objective one: its best configurations (by loss) run first, but TPE is
    # given no results (a point on the front needs a cost the earlier run never paid). That two-objective study
    # then seeds a single-objective one, which reads its quality objective only, results included.
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    earlier = _earlier(tmp_path, tiny_model, demo_files, url)
    best = sorted(earlier.trials, key=lambda t: t.value)[0]
    cost = 'metric = ["loss", "trainable_parameters"]'
    spec = _spec(tmp_path / "front.toml", demo_files, tiny_model, n_trials=1, space=EARLIER_SPACE, search="")
    spec.write_text(
        spec.read_text().replace('metric = "loss"', cost).replace("seed = 0", 'seed = 0\nwarm_start = "small"')
    )
    start_study("front", spec, url, tmp_path)
    front = optuna.load_study(study_name="front", storage=url)
    trials = front.get_trials(deepcopy=False)
    queued = [t for t in trials if t.user_attrs.get(attrs.WARM_START_OF)]  # at least one: the best
    assert [t.params for t in queued] == [best.params] and queued[0].values is not None
    assert not any(t.user_attrs.get(attrs.EARLIER_RESULT) for t in trials)
    assert front.user_attrs[attrs.WARM_START] == {"from": "small", "finished": 3, "queued": 1, "results": 0}

    spec = _spec(tmp_path / "one.toml", demo_files, tiny_model, n_trials=1, space=EARLIER_SPACE, search="")
    spec.write_text(spec.read_text().replace("seed = 0", 'seed = 0\nwarm_start = "front"'))
    start_study("one", spec, url, tmp_path)
    one = optuna.load_study(study_name="one", storage=url).get_trials(deepcopy=False)
    results = sorted((t.params["learning_rate"], t.value) for t in one if t.user_attrs.get(attrs.EARLIER_RESULT))
    # What the front study ran itself (not the result it was never given), each with its loss, the first objective.
    ran = warm_start.ran_here([t for t in trials if t.state == TrialState.COMPLETE])
    assert results == sorted((t.params["learning_rate"], t.values[0]) for t in ran) and results


def _refused(cli: Cli, tmp_path: Path, spec: Path, url: str, expected: str, study: str = "big") -> None:
    before = optuna.get_all_study_names(storage=url)
    result = cli("start", "--study", study, "--config", str(spec), "--storage", url, "--devices", "cpu:1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert optuna.get_all_study_names(storage=url) == before, "a refused warm start must write nothing"
    assert not (tmp_path / "hpsearch-runs" / study).exists()


def test_bad_warm_starts_exit_2_with_one_line_and_write_nothing(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = optuna.storages.RDBStorage(url)
    optuna.create_study(study_name="small", storage=storage, direction="minimize")
    optuna.create_study(study_name="accurate", storage=storage, direction="maximize")
    storage.engine.dispose()

    def spec(warm: str, name: str = "big.toml") -> Path:
        search = f"warm_start = {warm!r}".replace("'", '"')
        return _spec(tmp_path / name, demo_files, tiny_model, n_trials=3, space=NEW_SPACE, search=search)

    _refused(cli, tmp_path, spec("smal"), url, "study 'smal' does not exist")
    _refused(cli, tmp_path, spec("smal"), url, "(studies there: small, accurate)")
    _refused(cli, tmp_path, spec("big"), url, "search.warm_start: 'big' is this study itself")
    _refused(cli, tmp_path, spec(f"{url}#big"), url, "is this study itself")
    _refused(cli, tmp_path, spec("accurate"), url, "error: search.warm_start: study accurate has direction maximize")
    _refused(cli, tmp_path, spec("mysql://h/db#small"), url, "search.warm_start: storage URL 'mysql://h/db' uses")
    _refused(cli, tmp_path, spec(f"{url}"), url, "names a storage but no study")
    _refused(cli, tmp_path, spec("postgresql://u:secret@h/db#small"), url, "holds a password")
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    _refused(cli, tmp_path, spec(f"{missing}#small"), url, "search.warm_start: ")
    assert not (tmp_path / "nowhere.db").exists(), "the warm start's storage is only read"


def test_a_warm_start_into_a_new_storage_names_the_missing_study(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """A first `start` in a storage that does not exist yet: the earlier study cannot be in it."""
    spec = _spec(tmp_path / "big.toml", demo_files, tiny_model, n_trials=3, space=NEW_SPACE, search='warm_start = "x"')
    db = tmp_path / "new.db"
    argv = ("start", "--study", "big", "--config", str(spec), "--storage", f"sqlite:///{db}", "--devices", "cpu:1")
    result = cli(*argv, cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "search.warm_start: " in result.stderr and not db.exists(), result.stderr


def test_values_that_do_not_fit_are_left_out_and_a_study_is_given_only_whole_points(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """The earlier rows are input: a value off the grid, of the wrong type or outside the choices is left out."""
    from hpsearch.search.study.spec import load_file

    space = (
        'learning_rate = { type = "float", low = 1e-4, high = 1e-3, step = 1e-4 }\n'
        'batch_size = { type = "categorical", choices = [16, 32] }'
    )
    spec = load_file(_spec(tmp_path / "s.toml", demo_files, tiny_model, n_trials=9, space=space, search=""))
    dist = optuna.distributions
    rows = [
        ({"learning_rate": 2e-4, "batch_size": 32}, 0.5),  # fits
        ({"learning_rate": 2.5e-4, "batch_size": 16}, 0.1),  # off the grid: batch_size alone is queued
        ({"learning_rate": "3e-4", "batch_size": 64}, 0.2),  # a string, and not a choice: nothing fits
        ({"learning_rate": 4e-4, "batch_size": 16}, float("nan")),  # no value: not a finished result
    ]
    trials = [
        optuna.trial.create_trial(
            params=p,
            distributions={k: dist.CategoricalDistribution([v]) for k, v in p.items()},
            value=v if v == v else None,
            state=TrialState.COMPLETE if v == v else TrialState.FAIL,
        )
        for p, v in rows
    ]
    for n, t in enumerate(trials):
        t.number = n
    plan = warm_start.fit(spec, "small", trials, {"batch_size": 32})
    assert plan.finished == 3
    assert [q for q, _ in plan.queue] == [{"batch_size": 16}, {"learning_rate": 2e-4, "batch_size": 32}]
    # spec_text's sampler is tpe: it is given the one whole point, with its value.
    assert [(p, v) for p, v, _ in plan.results] == [({"learning_rate": 2e-4, "batch_size": 32}, 0.5)]
    assert any("not on the search grid" in line for line in plan.lines), plan.lines
    assert any("batch_size" in line and "not one of the choices" in line for line in plan.lines), plan.lines
    assert len(plan.lines) == 2, plan.lines  # one line a parameter


def _racing_start(url: str, spec_path: str, barrier: Any) -> str:
    """One `start`'s read of the warm start and its creation of "big", released with the other's."""
    from hpsearch.search.study import studies
    from hpsearch.search.study.spec import load_file

    spec = load_file(Path(spec_path))
    plan = warm_start.plan(spec, "big", url)
    storage = open_storage(url, create=True)
    try:
        barrier.wait(timeout=60)
        studies.create_or_resume(storage, "big", spec, plan)
        return "ok"
    finally:
        storage.close()


def test_two_racing_starts_apply_the_warm_start_once(
    storage_url: str, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    url = urls.normalize(storage_url)
    earlier = optuna.create_study(study_name="small", storage=url)
    lr = optuna.distributions.FloatDistribution(1e-5, 1e-2, log=True)
    for v, rate in ((0.3, 1e-4), (0.2, 3e-4), (0.4, 1e-3)):
        trial = optuna.trial.create_trial(params={"learning_rate": rate}, distributions={"learning_rate": lr}, value=v)
        earlier.add_trial(trial)
    space = 'learning_rate = { type = "float", low = 5e-5, high = 2e-3, log = true }'
    spec = _spec(tmp_path / "big.toml", demo_files, tiny_model, n_trials=6, space=space, search='warm_start = "small"')
    with closing(open_storage(storage_url, create=True)) as storage:
        storage.prepare()  # our tables first: their own race is test_schema_race's
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        results = [pool.apply_async(_racing_start, (storage_url, str(spec), barrier)) for _ in range(2)]
        assert [r.get(timeout=120) for r in results] == ["ok", "ok"]
    trials = optuna.load_study(study_name="big", storage=url).get_trials(deepcopy=False)
    queued = sorted((t for t in trials if t.user_attrs.get(attrs.WARM_START_OF)), key=lambda t: t.number)
    assert [t.system_attrs["fixed_params"]["learning_rate"] for t in queued] == [3e-4, 1e-4]  # best (lowest) first
    assert sorted(t.value for t in trials if t.user_attrs.get(attrs.EARLIER_RESULT)) == [0.2, 0.3, 0.4]
    # "big" ran nothing yet: a study warm-started from it gets none of the results "big" was only given.
    from hpsearch.search.study.spec import load_file

    third = _spec(tmp_path / "third.toml", demo_files, tiny_model, n_trials=6, space=space, search='warm_start = "big"')
    chained = warm_start.plan(load_file(third), "third", storage_url)
    assert chained is not None and chained.finished == 0 and not chained.queue and not chained.results
