"""Early pruning points: a trial validates at its pruner's early rungs, on a fixed subset of the validation rows,
the pruner is asked there, and a trial's value and its kept checkpoint come from full points only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import tomllib

from hpsearch.search.study import sampling
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers import early_stop
from hpsearch.search.workers.early_stop import FLAT, ChanceLevel, EarlyStop, PruningGate
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.evaluate import Metrics, evaluate
from hpsearch.trainer.loop import fit
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.points import EarlyPoints
from hpsearch.trainer.tokenised import Prepared
from tests.conftest import hpsearch, spec_text
from tests.support.tiny import tiny_run


def _spec(
    tiny_model: Path, demo_files: tuple[Path, Path], pruner: str = "median", early: bool = True, **search: Any
) -> StudySpec:
    raw = tomllib.loads(spec_text(tiny_model, *demo_files, early_points=early))
    raw["train"]["eval_every"] = 16
    raw["search"].update(pruner=pruner, **search)
    return StudySpec.from_dict(raw, base_dir=tiny_model.parent)


@pytest.fixture
def prepared(tiny_model: Path, demo_files: tuple[Path, Path]) -> tuple[Any, Prepared]:
    tok = load_tokenizer(str(tiny_model))
    return tok, prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)


def test_early_points_continue_the_rungs_below_the_first_validation_point(
    tiny_model: Path, demo_files: tuple[Path, Path], prepared: tuple[Any, Prepared]
) -> None:
    _, data = prepared  # 320 training rows, 96 validation rows
    cfg = TrainConfig(batch_size=16, epochs=1, eval_every=16)  # 20 steps
    # asha, eval_every 16, reduction factor 3: 16 // 3 and 16 // 9; the pruner's own rungs start at 16 as before.
    asha = _spec(tiny_model, demo_files, "asha")
    assert early_stop.early_points(asha, cfg, data) == EarlyPoints(frozenset({1, 5}), 96, 0)
    pruner = sampling.make_pruner(asha)
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner) and pruner._min_resource == 16
    assert early_stop.early_points(
        _spec(tiny_model, demo_files, "asha", pruner_reduction_factor=4), cfg, data
    ).steps == {
        1,
        4,
    }
    # median/percentile: a quarter and a half of the way to the first full point.
    assert early_stop.early_points(_spec(tiny_model, demo_files), cfg, data).steps == {4, 8}
    # No pruner, or early points off: none.
    assert early_stop.early_points(_spec(tiny_model, demo_files, "none"), cfg, data) == EarlyPoints()
    assert early_stop.early_points(_spec(tiny_model, demo_files, "asha", early=False), cfg, data) == EarlyPoints()
    # A subset smaller than the validation split where early_point_rows says so.
    assert early_stop.early_points(_spec(tiny_model, demo_files, early_point_rows=40), cfg, data).rows == 40


def test_an_early_point_that_costs_more_than_it_could_save_is_skipped(
    tiny_model: Path, demo_files: tuple[Path, Path], prepared: tuple[Any, Prepared]
) -> None:
    _, data = prepared
    one = TrainConfig(batch_size=1, micro_batch_size=1, epochs=1, eval_every=16)
    # Batch 1: a point at step 4 saves at most 4 rows of training before step 8; scoring 96 rows costs ~32.
    assert early_stop.early_points(_spec(tiny_model, demo_files), one, data).steps == set()
    # Scoring 12 rows (a third: 4) costs what the 4 steps from 4 to 8 could save: skipped; the point at 8 could
    # save 8 steps, but alone it never cuts (a flat curve needs two points): none. 9 rows (3) cost less than either.
    assert early_stop.early_points(_spec(tiny_model, demo_files, early_point_rows=12), one, data).steps == set()
    assert early_stop.early_points(_spec(tiny_model, demo_files, early_point_rows=9), one, data).steps == {4, 8}


def test_an_early_point_that_would_be_alone_is_not_kept(tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    # search_vs_hf's default shape: 1,024 training rows, batch 16, validation every 16 on 256 rows. Scoring 256 rows
    # (a third: 85) costs more than the 4 steps from 1 to 5 save (64 rows); the point at 5 (176 rows) pays, but it
    # would be the trial's only early point, and a flat curve needs two: none is validated for nothing.
    shape: Any = SimpleNamespace(train=range(1024), validation=range(256))
    asha = _spec(tiny_model, demo_files, "asha")
    cfg = TrainConfig(batch_size=16, epochs=2, eval_every=16)
    assert early_stop.early_points(asha, cfg, shape) == EarlyPoints()
    # Batch 32: both pay (85 rows against 128 and 352).
    assert early_stop.early_points(asha, replace(cfg, batch_size=32), shape) == EarlyPoints(frozenset({1, 5}), 256, 0)
    # A subset of 128 rows (43) pays at batch 16 too.
    fewer = _spec(tiny_model, demo_files, "asha", early_point_rows=128)
    assert early_stop.early_points(fewer, cfg, shape) == EarlyPoints(frozenset({1, 5}), 128, 0)


def test_the_early_subset_is_fixed_and_the_same_in_every_trial(prepared: tuple[Any, Prepared]) -> None:
    _, data = prepared
    a, b = (EarlyPoints(frozenset({2}), 40, seed=7).data(data.validation) for _ in range(2))
    assert len(a) == 40 and a.input_ids == b.input_ids and a.labels == b.labels
    other = EarlyPoints(frozenset({2}), 40, seed=8).data(data.validation)
    assert other.input_ids != a.input_ids
    assert EarlyPoints(frozenset({2}), 0).data(data.validation) is data.validation


def test_a_warming_trial_is_judged_by_what_its_peak_rate_would_do() -> None:
    # 64 steps, an 18-step warm-up, early points at 1 and 5: the four steps between them run at 2/19..5/19 of the
    # peak rate (0.74 of a step at the peak in all), so a loss fall of f there is what 4 / 0.74 = 5.4 f would be
    # at the peak. Measured on SST-2 (benchmarks/README.md): a learning rate of 3.6e-4 in its warm-up fell
    # 0.0076 (0.041 at its peak: far from flat); 1.5e-6..1e-5 fell 0.0001..0.0003 (flat at any scale).
    prior = ChanceLevel.of([0, 1] * 128)
    assert prior is not None

    def cut(warmup: int, fall: float) -> bool | None:
        gate = PruningGate(prior, warmup, 64, "accuracy", early=frozenset({1, 5}))
        assert gate.cut_early(1, Metrics(loss=prior.loss + 0.01, accuracy=0.45)) is False  # nothing to compare
        return gate.cut_early(5, Metrics(loss=prior.loss + 0.01 - fall, accuracy=0.45))

    assert PruningGate(prior, 18, 64, "accuracy").at_peak(1, 5) == pytest.approx(4 / (14 / 19))
    assert PruningGate(prior, 0, 64, "accuracy").at_peak(1, 5) == pytest.approx(4 / (63 + 62 + 61 + 60) * 64)
    fall = 0.5 * FLAT * prior.loss  # half what a flat curve may fall: flat at the peak rate (no warm-up)
    assert cut(0, fall) is True
    # The same fall inside an 18-step warm-up is 2.7 times the flat bound at the peak rate: it learns, go on.
    assert cut(18, fall) is False
    assert cut(18, 0.0002) is True  # a rate too low to learn is cut in its warm-up too (the old rule waited)
    # Not at chance (loss below the prior's): never cut, however flat.
    gate = PruningGate(prior, 0, 64, "accuracy", early=frozenset({1, 5}))
    gate.cut_early(1, Metrics(loss=prior.loss - 0.05, accuracy=0.45))
    assert gate.cut_early(5, Metrics(loss=prior.loss - 0.05, accuracy=0.45)) is False
    assert gate.cut_early(16, Metrics(loss=prior.loss, accuracy=0.5)) is None  # a full point: the pruner's


class _Recorder(NullReporter):
    def __init__(self) -> None:
        super().__init__()
        self.points: dict[int, Metrics | None] = {}
        self.saved: list[int] = []

    def report(self, value: float, step: int, metrics: Metrics | None = None) -> None:
        super().report(value, step, metrics)
        self.points[step] = metrics

    def best_saved(self, path: Path, step: int, values: dict[str, float]) -> None:
        super().best_saved(path, step, values)
        self.saved.append(step)


def test_a_trial_reports_early_points_on_the_subset_and_saves_only_from_full_points(
    tiny_model: Path, prepared: tuple[Any, Prepared], tmp_path: Path
) -> None:
    tok, data = prepared
    cfg = TrainConfig(batch_size=32, micro_batch_size=32, epochs=2, eval_every=6, learning_rate=1e-3)  # 20 steps
    early = EarlyPoints(frozenset({2, 4}), 24, seed=3)
    reporter = _Recorder()
    run = tiny_run(tiny_model, (tok, data), cfg, tmp_path, early=early)
    result = fit(run, reporter)
    assert sorted(reporter.values) == [2, 4, 6, 12, 18, 20]
    # Early points scored the 24 fixed rows: the metrics a fresh evaluation of that subset gives for this model
    # differ from the full set's at the last point, and an early point's accuracy is a multiple of 1/24.
    for step in (2, 4):
        metrics = reporter.points[step]
        assert metrics is not None and metrics.accuracy is not None
        assert round(metrics.accuracy * 24, 6) == round(metrics.accuracy * 24)
    final = evaluate(
        run.model,
        early.data(data.validation),
        pad_id=data.pad_id,
        batch_size=8,
        device=run.device,
        precision="fp32",
        num_labels=2,
    )
    assert final.loss != pytest.approx(reporter.values[20], abs=0)  # the last (full) point is not the subset's
    # Nothing saved at an early point; the trial's best is a full point's.
    assert reporter.saved and not {2, 4} & set(reporter.saved)
    assert result.best_step in {6, 12, 18, 20}
    assert result.best_value == reporter.values[result.best_step]


class _AlwaysPrune(_Recorder):
    def should_prune(self) -> bool:
        return True


@pytest.mark.parametrize("learning_rate,stopped_at", [(1e-6, 4), (0.9, 6)])
def test_an_early_point_cuts_a_flat_trial_at_chance_and_leaves_a_moving_one_to_the_pruner(
    tiny_model: Path, prepared: tuple[Any, Prepared], tmp_path: Path, learning_rate: float, stopped_at: int
) -> None:
    # lr 1e-6 learns nothing: at the label prior's loss at steps 2 and 4 and no lower at 4, it is cut there (at 2
    # there is no earlier point to say the curve is flat), though the pruner would prune anywhere. lr 0.9 blows
    # the loss up, then it falls fast (9.9, 6.6, 4.0): not flat, so the early points leave it alone and the first
    # full point asks the pruner, which says prune.
    tok, data = prepared
    cfg = TrainConfig(
        batch_size=32, micro_batch_size=32, epochs=2, eval_every=6, warmup_ratio=0.0, learning_rate=learning_rate
    )
    reporter = _AlwaysPrune()
    gate = PruningGate.of_run(data, cfg, "loss", prune_at_chance=0, patient=True)
    gate.early = frozenset({2, 4})
    early = EarlyStop(reporter, gate)
    run = tiny_run(tiny_model, (tok, data), cfg, tmp_path, early=EarlyPoints(gate.early, 24))
    result = fit(run, early)
    assert (result.status, result.steps) == ("pruned", stopped_at), reporter.points
    if stopped_at == 4:
        assert early.reason == "at_chance"
        assert result.best_value is None and reporter.saved == []  # no full point: no value, no checkpoint
    else:
        assert early.reason is None and reporter.saved == [6]


def test_asha_cuts_flat_trials_at_an_early_point_through_the_cli(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    # 320 rows, batch 32, 2 epochs: 20 steps, full points every 9 (9, 18, 20); asha's early points at 9 // 3 = 3
    # and 9 // 9 = 1. The tiny model learns nothing in a few steps at these rates (its loss stays within 0.001 of
    # the prior's): trial 0 (lr 1e-3) is in its warm-up there (10 steps), judged by what its peak rate would do,
    # and cut at step 3 as trial 1 (lr 1e-6, no warm-up) is, not at 9 as without early points.
    spec = tmp_path / "early.toml"
    enqueue = (
        "[[search.enqueue]]\nlearning_rate = 1e-3\nwarmup_ratio = 0.5\n"
        "[[search.enqueue]]\nlearning_rate = 1e-6\nwarmup_ratio = 0.0\n[search.space]"
    )
    spec.write_text(
        spec_text(
            tiny_model,
            *demo_files,
            n_trials=2,
            space='learning_rate = { type = "float", low = 1e-6, high = 1.0, log = true }\n'
            'warmup_ratio = { type = "float", low = 0.0, high = 0.6 }',
            early_points=True,
        )
        .replace('pruner = "median"', 'pruner = "asha"')
        .replace("eval_every = 5", "eval_every = 9")
        .replace("[search.space]", enqueue)
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch(
        *("start", "--study", "e", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "no trial completed: 2 pruned (2 at chance)" in result.stderr, result.stderr
    for trial in optuna.load_study(study_name="e", storage=url).trials:
        assert trial.state == optuna.trial.TrialState.PRUNED, trial.intermediate_values
        assert sorted(trial.intermediate_values) == [1, 3]
        assert trial.user_attrs["fail_reason"] == "at_chance"
        assert "best_checkpoint" not in trial.user_attrs  # nothing is saved at an early point
