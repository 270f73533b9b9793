"""Search settings in the spec: samplers, pruners, budgets, retention, enqueue; errors name the field."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from hpsearch.search.errors import SpecError
from hpsearch.search.study import sampling
from hpsearch.search.study.sobol import SobolSampler
from hpsearch.search.study.spec import StudySpec, tomllib
from tests.conftest import hpsearch, spec_text

SPACE = (
    'learning_rate = { type = "float", low = 1e-4, high = 3e-3, log = true }\n'
    'warmup_ratio = { type = "float", low = 0.0, high = 0.2, step = 0.1 }\n'
    'micro_batch_size = { type = "categorical", choices = [8, 16] }'
)


GRID_SPACE = (
    'learning_rate = { type = "categorical", choices = [1e-4, 1e-3] }\n'
    'warmup_ratio = { type = "float", low = 0.0, high = 0.2, step = 0.1 }\n'
    'micro_batch_size = { type = "categorical", choices = [8, 16] }'
)


def make_override(search: str, space: str = SPACE) -> StudySpec:
    """conftest's spec (pruner = "median", sampler = "tpe") with our [search] keys on top."""
    raw = tomllib.loads(spec_text(Path("/m"), Path("/t.jsonl"), Path("/v.jsonl"), space=space))
    raw["search"].update(tomllib.loads(search))
    return StudySpec.from_dict(raw)


def test_defaults_are_qmc_and_asha_from_the_first_validation_point() -> None:
    raw = tomllib.loads(spec_text(Path("/m"), Path("/t.jsonl"), Path("/v.jsonl"), space=SPACE))
    del raw["search"]["pruner"], raw["search"]["sampler"]
    spec = StudySpec.from_dict(raw)
    assert spec.search.pruner == "asha" and spec.search.sampler == "qmc"
    assert isinstance(sampling.make_sampler(spec, 1), SobolSampler)
    assert spec.search.keep_top_k == 3 and spec.search.max_disk_gb == 0
    pruner = sampling.make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner)
    # The first rung is the first validation point (eval_every = 5 in conftest's spec).
    assert pruner._min_resource == 5
    assert pruner._reduction_factor == 3


@pytest.mark.parametrize(
    ("search", "kind", "checks"),
    [
        ("", optuna.pruners.MedianPruner, {"_n_startup_trials": 2, "_n_warmup_steps": 0}),
        ('pruner = "none"', optuna.pruners.NopPruner, {}),
        (
            'pruner = "percentile"\npruner_percentile = 10.0\npruner_warmup_steps = 7',
            optuna.pruners.PercentilePruner,
            {"_percentile": 10.0, "_n_warmup_steps": 7},
        ),
        (
            'pruner = "asha"\npruner_min_resource = 4\npruner_reduction_factor = 4',
            optuna.pruners.SuccessiveHalvingPruner,
            {"_min_resource": 4, "_reduction_factor": 4},
        ),
        (
            'pruner = "hyperband"\npruner_min_resource = 4\npruner_reduction_factor = 2',
            optuna.pruners.HyperbandPruner,
            {"_min_resource": 4, "_reduction_factor": 2},
        ),
    ],
)
def test_pruner_parameters_reach_optuna(search: str, kind: type, checks: dict[str, object]) -> None:
    pruner = sampling.make_pruner(make_override(search))
    assert isinstance(pruner, kind)
    for attr, value in checks.items():
        assert getattr(pruner, attr) == value, attr


@pytest.mark.parametrize(
    ("sampler", "kind"),
    [
        ("tpe", optuna.samplers.TPESampler),
        ("random", optuna.samplers.RandomSampler),
        ("gp", optuna.samplers.GPSampler),
        ("grid", optuna.samplers.GridSampler),
        ("qmc", SobolSampler),
    ],
)
def test_samplers(sampler: str, kind: type) -> None:
    spec = make_override(f'sampler = "{sampler}"', space=GRID_SPACE if sampler == "grid" else SPACE)
    assert isinstance(sampling.make_sampler(spec, 1), kind)


def test_tpe_is_multivariate_with_a_constant_liar() -> None:
    tpe = sampling.make_sampler(make_override('sampler = "tpe"'), 1)
    assert tpe._multivariate and tpe._constant_liar


def test_cmaes_and_grid_space() -> None:
    floats = 'learning_rate = { type = "float", low = 1e-4, high = 3e-3, log = true }'
    raw = tomllib.loads(spec_text(Path("/m"), Path("/t.jsonl"), Path("/v.jsonl"), space=floats))
    raw["search"]["sampler"] = "cmaes"
    assert isinstance(sampling.make_sampler(StudySpec.from_dict(raw), 1), optuna.samplers.CmaEsSampler)
    grid = sampling.grid_space(make_override('sampler = "grid"', space=GRID_SPACE))
    assert grid["warmup_ratio"] == [0.0, 0.1, 0.2]
    assert grid["micro_batch_size"] == [8, 16]


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ('sampler = "bayes"', "search.sampler: 'bayes' must be one of 'tpe', 'random', 'gp', 'cmaes', 'grid', 'qmc'"),
        ('pruner = "sha"', "search.pruner: 'sha' must be one of"),
        ('metric = "auc"', "search.metric: 'auc' must be one of 'loss', 'accuracy', 'f1'"),
        ("pruner_reduction_factor = 1", "search.pruner_reduction_factor: 1 must be >= 2"),
        ("pruner_percentile = 100.0", "search.pruner_percentile: 100.0 must be between 0 and 100"),
        ("keep_top_k = 0", "search.keep_top_k: 0 must be >= 1"),
        ("max_disk_gb = -1", "search.max_disk_gb: -1.0 must be a finite number >= 0"),
        ("gpu_hours = -0.5", "search.gpu_hours: -0.5 must be a finite number >= 0"),
        ("timeout_minutes = -1", "search.timeout_minutes: -1.0 must be a finite number >= 0"),
        ("keep_top = 2", "search.keep_top: unknown key"),
        ('sampler = "cmaes"', "search.space.micro_batch_size: cmaes samples only float and int"),
        ("enqueue = [{ learning_rate = 1.0 }]", "search.enqueue[0].learning_rate: 1.0 is outside the search range"),
        ("enqueue = [{ lr = 1e-3 }]", "search.enqueue[0].lr: not a parameter of [search.space]"),
        ("enqueue = [{ micro_batch_size = 12 }]", "search.enqueue[0].micro_batch_size: 12 is not one of the choices"),
        ("enqueue = { learning_rate = 1e-3 }", "search.enqueue: must be an array of tables"),
    ],
)
def test_bad_search_settings_name_the_field(search: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        make_override(search)
    assert message in str(err.value)


def test_grid_needs_a_step_for_floats() -> None:
    raw = tomllib.loads(spec_text(Path("/m"), Path("/t.jsonl"), Path("/v.jsonl")))
    raw["search"]["sampler"] = "grid"
    with pytest.raises(SpecError, match=r"search.space.learning_rate: the grid sampler needs a step"):
        StudySpec.from_dict(raw)


def test_enqueue_round_trips_through_storage() -> None:
    spec = make_override("enqueue = [{ learning_rate = 1e-3, micro_batch_size = 8 }, { learning_rate = 2e-4 }]")
    assert spec.enqueue == [{"learning_rate": 1e-3, "micro_batch_size": 8}, {"learning_rate": 2e-4}]
    again = StudySpec.from_dict(spec.to_dict())
    assert again.enqueue == spec.enqueue and again.identity() == spec.identity()


def test_bad_sampler_through_the_cli_is_one_line_and_writes_nothing(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(spec_text(tiny_model, *demo_files).replace('sampler = "tpe"', 'sampler = "grid"'))
    result = hpsearch(
        "start",
        "--study",
        "bad",
        "--config",
        str(spec),
        "--storage",
        f"sqlite:///{tmp_path / 'db.sqlite'}",
        "--devices",
        "cpu:1",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "search.space.learning_rate: the grid sampler needs a step" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "db.sqlite").exists()
