"""Defaults from what is known: a LoRA study that gives no learning rate searches the published optimum
(1e-4..1e-3, log), says so in one line at `start`, and a searched rank is not judged by the pruner early."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from hpsearch.search.study.space import Param
from hpsearch.search.study.spec import LORA_LEARNING_RATES, StudySpec
from hpsearch.search.workers.early_stop import PruningGate
from hpsearch.trainer.evaluate import Metrics
from tests.conftest import spec_text, start_study
from tests.test_lora import with_adapter

BASE: dict[str, Any] = {"model": {"name": "m"}, "data": {"train": "a", "validation": "b"}}
LORA = {"method": "lora", "r": 4}
RANKS = '"adapter.r" = { type = "categorical", choices = [2, 4] }'
RANK_PARAM = {"type": "categorical", "choices": [2, 4]}
EPOCHS = {"type": "int", "low": 1, "high": 2}


def test_a_lora_spec_without_a_learning_rate_searches_the_published_range() -> None:
    spec = StudySpec.from_dict({**BASE, "adapter": LORA, "search": {"space": {}}})
    assert spec.space["learning_rate"] == Param("learning_rate", "float", low=1e-4, high=1e-3, log=True)
    assert spec.space["learning_rate"] == LORA_LEARNING_RATES
    [line] = spec.defaults_added
    assert "search.space.learning_rate" in line and "searching 1e-4..1e-3 (log)" in line
    # The stored spec holds the choice itself: it reads back the same, and says nothing more.
    stored = StudySpec.from_dict(spec.to_dict())
    assert stored.identity() == spec.identity() and stored.defaults_added == []


def test_a_learning_rate_given_anywhere_or_a_grid_or_a_full_fine_tune_gets_no_default_range() -> None:
    given = [
        {**BASE, "adapter": LORA, "train": {"learning_rate": 2e-4}},
        {**BASE, "adapter": LORA, "search": {"space": {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2}}}},
        {**BASE, "adapter": LORA, "search": {"sampler": "grid", "space": {"epochs": EPOCHS}}},
        BASE,
    ]
    specs = [StudySpec.from_dict(raw) for raw in given]
    assert [s.space.get("learning_rate") for s in specs] == [
        None,
        Param("learning_rate", "float", low=1e-5, high=1e-2),
        None,
        None,
    ]
    assert all(not s.defaults_added for s in specs)


def _gate(*, rank_searched: bool) -> PruningGate:
    return PruningGate(None, warmup=0, total_steps=30, metric="loss", patient=True, rank_searched=rank_searched)


def test_a_searched_rank_is_not_judged_in_the_first_third_of_a_trial() -> None:
    point = Metrics(loss=0.7)
    assert [_gate(rank_searched=True).may_prune(s, point) for s in (5, 9, 10, 30)] == [False, False, True, True]
    assert all(_gate(rank_searched=False).may_prune(s, point) for s in (5, 9, 10, 30))
    assert StudySpec.from_dict({**BASE, "adapter": LORA, "search": {"space": {"adapter.r": RANK_PARAM}}}).searches_rank
    assert not StudySpec.from_dict({**BASE, "adapter": LORA}).searches_rank


def test_start_says_the_default_range_was_added_and_trials_draw_from_it(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    text = with_adapter(spec_text(tiny_model, *demo_files, n_trials=2, space=RANKS))
    spec = tmp_path / "lora.toml"
    spec.write_text(text.replace("learning_rate = 1e-3\n", "", 1))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = start_study("lora", spec, url, tmp_path)
    said = [line for line in result.stderr.splitlines() if "search.space.learning_rate: none given" in line]
    assert len(said) == 1, result.stderr[-3000:]
    trials = optuna.load_study(study_name="lora", storage=url).trials
    assert len(trials) == 2
    for t in trials:
        assert set(t.params) == {"adapter.r", "learning_rate"}
        assert 1e-4 <= t.params["learning_rate"] <= 1e-3
