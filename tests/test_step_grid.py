"""No step setting crashes a trial: every pruner, with early points on, for eval_every 1, 2, 3, 5 and runs of 1 to 10
optimizer steps, whether the length comes from max_steps or from the data. The pure part (where early points and
full points go, and what the real Optuna pruners answer there) runs exhaustively in memory; a few real `hpsearch
start` runs on the tiny model check the same end to end."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
import tomllib

from hpsearch.search.study import sampling
from hpsearch.search.study.search_config import PRUNERS
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers import early_stop
from hpsearch.search.workers.early_stop import EarlyStop, PruningGate
from hpsearch.search.workers.trial_attrs import TrialReporter
from hpsearch.trainer.evaluate import Metrics
from hpsearch.trainer.optim import plan_steps
from hpsearch.trainer.points import EarlyPoints, point_at
from tests.conftest import Cli, assert_refused, hpsearch, spec_text

EVAL_EVERY = (1, 2, 3, 5)
LENGTHS = range(1, 11)
BATCH = 4
TRIALS = 6


@dataclass
class _Validation:
    """What early_points and PruningGate read of a validation split: its size and its labels."""

    labels: list[int]
    task: str = "classification"  # the chance stop's prior is the task's

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class _Shape:
    """A prepared data set's shape: ``train`` rows and a validation split of balanced labels."""

    train: range
    validation: _Validation


def _spec(pruner: str, eval_every: int, max_steps: int, factor: int, metric: str, epochs: int = 1) -> StudySpec:
    # Paths are not opened here: the spec is checked, not run.
    where = Path("/nonexistent")
    raw = tomllib.loads(spec_text(where / "model", where / "t.jsonl", where / "d.jsonl", early_points=True))
    raw["train"].update(
        eval_every=eval_every, max_steps=max_steps, batch_size=BATCH, micro_batch_size=BATCH, epochs=epochs
    )
    raw["search"].update(
        pruner=pruner, metric=metric, pruner_reduction_factor=factor, prune_at_chance=2, pruner_startup_trials=1
    )
    return StudySpec.from_dict(raw, base_dir=where)


def _runs() -> list[tuple[str, int, int, str, int]]:
    """(pruner, eval_every, length, how the length is set, reduction factor): every combination."""
    runs = []
    routes = ("max_steps", "data", "epochs")
    for pruner, eval_every, length, route in itertools.product(PRUNERS, EVAL_EVERY, LENGTHS, routes):
        if route == "epochs" and length % 2:
            continue  # two epochs of length / 2 steps each
        # asha/hyperband's early points are eval_every // factor^k: factor 2 places some within 5 steps, 3 fewer.
        for factor in (2, 3) if pruner in ("asha", "hyperband") else (3,):
            runs.append((pruner, eval_every, length, route, factor))
    return runs


def _metrics(trial: int, step: int, length: int) -> Metrics:
    """Curves of several kinds: falling at different rates (the pruner has a worse one to cut) and flat at the label
    prior's loss with accuracy at chance (the early points and the chance stop have one to cut)."""
    if trial % 3 == 2:
        return Metrics(loss=0.70, accuracy=0.5)
    loss = 0.69 - 0.3 * step / length / (1 + trial)
    return Metrics(loss=loss, accuracy=0.5 + 0.4 * step / length / (1 + trial))


def _search(spec: StudySpec, shape: _Shape) -> tuple[list[optuna.trial.FrozenTrial], list[int]]:
    """Run TRIALS trials through the real pruner, EarlyStop and TrialReporter, placing points as fit does: each
    trial ends complete or pruned (an exception fails the test). Returns the trials and the steps of one trial's
    points."""
    cfg = spec.train
    total, _ = plan_steps(len(shape.train), cfg.batch_size, cfg.epochs, cfg.max_steps)
    early = early_stop.early_points(spec, cfg, shape)  # type: ignore[arg-type]
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction=spec.direction, pruner=sampling.make_pruner(spec))
    placed: list[int] = []
    for number in range(TRIALS):
        trial = study.ask()
        gate = PruningGate.of_search(shape, cfg, spec.search, early=early.steps)
        judge = EarlyStop(TrialReporter(trial, storage), gate)
        last: float | None = None
        for step in range(1, total + 1):
            point = point_at(step, total, cfg.eval_every, early)
            if point is None:
                continue
            if number == 0:
                placed.append(step)
            metrics = _metrics(number, step, total)
            value = metrics.objective(spec.search.quality)
            judge.report(value, step, metrics)
            last = value if point == "full" else last
            if judge.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            assert last is not None, "a run ended without a full validation point"
            study.tell(trial, last)
    return study.get_trials(deepcopy=False), placed


def test_every_pruner_eval_every_and_run_length_places_points_and_ends_every_trial() -> None:
    pruned_by: dict[str, int] = dict.fromkeys(PRUNERS, 0)
    with_early = 0
    for pruner, eval_every, length, route, factor in _runs():
        for metric in ("loss", "accuracy"):
            epochs = 2 if route == "epochs" else 1
            spec = _spec(pruner, eval_every, length if route == "max_steps" else 0, factor, metric, epochs)
            # The last epoch's last batch is short (BATCH - 1 rows): plan_steps still counts it as a step.
            rows = 1000 if route == "max_steps" else length // epochs * BATCH - 1
            shape = _Shape(range(rows), _Validation([0, 1] * 4))
            said = f"{pruner} eval_every {eval_every}, {length} steps from {route}, factor {factor}, {metric}"
            assert plan_steps(rows, BATCH, epochs, spec.train.max_steps)[0] == length, said
            early = early_stop.early_points(spec, spec.train, shape)  # type: ignore[arg-type]
            first = min(eval_every, length)
            # Early points lie below the first full point, and none is a full point itself.
            assert all(1 <= s < first for s in early.steps), said
            assert all(point_at(s, length, eval_every, early) == "early" for s in early.steps), said
            with_early += bool(early.steps)
            trials, placed = _search(spec, shape)
            assert placed[-1] == length, said  # the last step is always a full point
            states = {t.state for t in trials}
            assert states <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}, said
            pruned_by[pruner] += sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    # The grid is not vacuous: early points were placed, and every pruner cut trials ("none" never does).
    assert with_early > 0
    assert pruned_by.pop("none") == 0 and all(n > 0 for n in pruned_by.values()), pruned_by


@pytest.mark.parametrize("eval_every", [1, 2])
def test_a_first_point_at_step_1_or_2_has_no_early_points_and_does_not_crash(eval_every: int) -> None:
    # The reported crash: candidates {eval_every // 3, eval_every // 9} - {0} is empty, and the points after them
    # were built as [*candidates[1:], first]: one more than there are candidates (zip(strict=True) raised).
    for pruner in ("asha", "hyperband", "median", "percentile"):
        spec = _spec(pruner, eval_every, 0, 3, "loss")
        shape = _Shape(range(40 * BATCH), _Validation([0, 1] * 4))
        assert early_stop.early_points(spec, spec.train, shape).steps == frozenset()  # type: ignore[arg-type]


def test_the_placement_rule() -> None:
    early = EarlyPoints(frozenset({1, 2}))
    assert [point_at(s, 7, 3, early) for s in range(1, 8)] == ["early", "early", "full", None, None, "full", "full"]
    assert [point_at(s, 1, 5, EarlyPoints()) for s in (1,)] == ["full"]


def _start(tmp_path: Path, text: str, study: str) -> tuple[Any, list[optuna.trial.FrozenTrial]]:
    spec = tmp_path / f"{study}.toml"
    spec.write_text(text)
    url = f"sqlite:///{tmp_path / study}.db"
    result = hpsearch(
        *("start", "--study", study, "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    return result, optuna.load_study(study_name=study, storage=url).trials


@pytest.mark.parametrize(
    ("pruner", "train", "train_rows"),
    [
        ("asha", "eval_every = 1\nmax_steps = 4", 320),  # the reported crash: every trial failed
        ("hyperband", "eval_every = 5\nmax_steps = 1", 320),  # a one-step run
        ("percentile", "eval_every = 50", 32),  # a small file: one step an epoch, its only point at step 1
    ],
)
def test_short_runs_end_every_trial_through_hpsearch_start(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pruner: str, train: str, train_rows: int
) -> None:
    train_file, dev = demo_files
    if train_rows != 320:
        train_file = tmp_path / "small.jsonl"
        train_file.write_text("".join(demo_files[0].read_text().splitlines(keepends=True)[:train_rows]))
    text = spec_text(tiny_model, train_file, dev, n_trials=3, early_points=True, extra_train=train)
    text = text.replace("eval_every = 5\n", "").replace('pruner = "median"', f'pruner = "{pruner}"')
    text = text.replace("epochs = 2", "epochs = 1")
    result, trials = _start(tmp_path, text, f"short-{pruner}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(trials) == 3
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials), [
        (t.number, t.state, t.user_attrs.get("fail_reason")) for t in trials
    ]


@pytest.mark.parametrize(
    ("search", "train", "expected"),
    [
        (
            'pruner = "asha"\npruner_min_resource = 8',
            "max_steps = 8",
            "search.pruner_min_resource: 8 is not below train.max_steps (8): the asha pruner could judge a trial only "
            "at its last step",
        ),
        (
            'pruner = "percentile"\npruner_warmup_steps = 20',
            "max_steps = 10",
            "search.pruner_warmup_steps: 20 is not below train.max_steps (10)",
        ),
    ],
)
def test_a_pruner_that_could_judge_only_the_last_step_is_refused_at_spec_time(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], search: str, train: str, expected: str
) -> None:
    text = spec_text(tiny_model, *demo_files, extra_train=train).replace('pruner = "median"', search)
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    assert_refused(cli, spec, tmp_path, expected)


def test_a_searched_max_steps_below_the_first_rung_is_refused(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    space = 'max_steps = { type = "categorical", choices = [4, 20] }'
    text = spec_text(tiny_model, *demo_files, space=space).replace(
        'pruner = "median"', 'pruner = "hyperband"\npruner_min_resource = 6'
    )
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    assert_refused(cli, spec, tmp_path, "search.space.max_steps: value 4 gives an invalid trial: search.pruner_min")
