"""The qmc sampler: a scrambled Sobol sequence, indexed by trial number, shared by every worker."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hpsearch.search.study import sampling
from hpsearch.search.study.sobol import SobolSampler, scale
from hpsearch.search.study.spec import StudySpec, tomllib
from tests.conftest import spec_text

SPACE = (
    'learning_rate = { type = "float", low = 1e-6, high = 1e-3, log = true }\n'
    'warmup_ratio = { type = "float", low = 0.0, high = 0.3 }\n'
    'micro_batch_size = { type = "categorical", choices = [8, 16, 32] }'
)


def qmc_spec(seed: int = 0) -> StudySpec:
    raw = tomllib.loads(spec_text(Path("/m"), Path("/t.jsonl"), Path("/v.jsonl"), space=SPACE))
    raw["search"].update({"sampler": "qmc", "seed": seed})
    return StudySpec.from_dict(raw)


def draw(study: optuna.Study, spec: StudySpec) -> dict[str, object]:
    trial = study.ask()
    params = sampling.suggest(trial, spec)
    study.tell(trial, 0.0)
    return params


def test_eight_trials_put_one_learning_rate_in_each_eighth_of_the_log_range() -> None:
    spec = qmc_spec()
    sampler = sampling.make_sampler(spec, seed=123)
    assert isinstance(sampler, SobolSampler)
    study = optuna.create_study(sampler=sampler)
    eighths = []
    for _ in range(8):
        lr = float(draw(study, spec)["learning_rate"])  # type: ignore[arg-type]
        assert 1e-6 <= lr <= 1e-3
        eighths.append(int((math.log10(lr) + 6) / 3 * 8))
    # Independent random draws leave some eighth empty 99.8% of the time.
    assert sorted(eighths) == list(range(8))


def test_workers_with_their_own_seeds_walk_one_sequence_without_repeats(tmp_path: Path) -> None:
    """Two workers (each with the seed a worker derives) taking turns on one stored study get
    the points a lone worker gets: the sequence position is the trial number."""
    spec = qmc_spec(seed=7)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(study_name="s", storage=url)
    workers = [
        optuna.load_study(study_name="s", storage=url, sampler=sampling.make_sampler(spec, seed))
        for seed in (sampling.worker_seed(spec, "host-a/cuda:0", 0), sampling.worker_seed(spec, "host-b/cuda:0", 0))
    ]
    shared = [draw(workers[i % 2], spec) for i in range(10)]
    alone = optuna.create_study(sampler=sampling.make_sampler(spec, seed=99))
    assert shared == [draw(alone, spec) for _ in range(10)]
    assert len({p["learning_rate"] for p in shared}) == 10
    # Another search.seed scrambles the sequence differently.
    other = optuna.create_study(sampler=sampling.make_sampler(qmc_spec(seed=8), seed=99))
    assert [draw(other, spec) for _ in range(10)] != shared


@pytest.mark.parametrize(
    ("dist", "values"),
    [
        (FloatDistribution(0.0, 0.2, step=0.1), [0.0, 0.1, 0.2]),
        (IntDistribution(8, 32, step=8), [8, 16, 24, 32]),
        (IntDistribution(1, 4), [1, 2, 3, 4]),
        (IntDistribution(1, 64, log=True), list(range(1, 65))),
        (CategoricalDistribution(["adamw", "sgd"]), ["adamw", "sgd"]),
    ],
)
def test_every_value_of_a_discrete_range_is_reachable_and_nothing_outside(
    dist: optuna.distributions.BaseDistribution, values: list[object]
) -> None:
    seen = [scale(i / 4096, dist) for i in range(4096)] + [scale(1 - 1e-12, dist)]
    assert sorted(set(seen), key=values.index) == values
    for value in seen:
        assert dist._contains(dist.to_internal_repr(value))


def test_continuous_ranges_keep_their_ends_and_scale() -> None:
    log = FloatDistribution(1e-6, 1e-3, log=True)
    assert scale(0.0, log) == pytest.approx(1e-6)
    assert scale(0.5, log) == pytest.approx(10**-4.5)
    assert scale(1 - 1e-12, log) <= 1e-3
    assert scale(0.25, FloatDistribution(0.0, 0.4)) == pytest.approx(0.1)
    # A log int range is spread on the log scale too: the middle quantile of 1..64 is ~6, not 32.
    assert scale(0.5, IntDistribution(1, 64, log=True)) == 6


def test_an_enqueued_trial_takes_its_place_in_the_sequence_and_the_rest_follow_it() -> None:
    """A known-good start (or a crashed trial's retry) uses its trial number's point: parameters
    it leaves out come from that point, and later trials continue the sequence unchanged."""
    spec = qmc_spec()
    plain = optuna.create_study(sampler=sampling.make_sampler(spec, seed=1))
    expected = [draw(plain, spec) for _ in range(4)]
    study = optuna.create_study(sampler=sampling.make_sampler(spec, seed=2))
    study.enqueue_trial({"learning_rate": 1e-4})
    got = [draw(study, spec) for _ in range(4)]
    assert got[0] == {**expected[0], "learning_rate": 1e-4}
    assert got[1:] == expected[1:]
