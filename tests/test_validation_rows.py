"""data.validation_rows (issue 58, item 4): every point of a trial scored on the same seeded N validation rows, and
the trial's best re-scored on all of them for its value; the same rows on every worker."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForSequenceClassification

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.storage import attrs
from hpsearch.trainer.config import ConfigError, DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.evaluate import evaluate
from hpsearch.trainer.loop import fit
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.points import PointRows
from hpsearch.trainer.tokenised import Encoded, Prepared
from tests.conftest import Cli, assert_refused, spec_text
from tests.support.tiny import tiny_run


@pytest.fixture
def prepared(tiny_model: Path, demo_files: tuple[Path, Path]) -> tuple[Any, Prepared]:
    tok = load_tokenizer(str(tiny_model))
    return tok, prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)


def _score(model: Any, data: Prepared, validation: Encoded) -> Any:
    return evaluate(
        model, validation, pad_id=data.pad_id, batch_size=8, device=model.device, precision="fp32", num_labels=2
    )


def test_points_score_the_n_rows_and_the_trial_value_the_best_on_every_row(
    tiny_model: Path, prepared: tuple[Any, Prepared], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok, data = prepared  # 96 validation rows
    cfg = TrainConfig(batch_size=32, micro_batch_size=32, epochs=2, eval_every=4, learning_rate=1e-3)  # 20 steps
    rows = PointRows(24, seed=5)
    reporter = NullReporter()
    run = tiny_run(tiny_model, (tok, data), cfg, tmp_path, metric="accuracy", point_rows=rows)
    caplog.set_level(logging.INFO, "hpsearch.trainer.loop")
    result = fit(run, reporter)
    assert sorted(reporter.values) == [4, 8, 12, 16, 20]
    assert reporter.attrs["point_rows"] == 24 and reporter.attrs["final_rows"] == 96
    # Each point's accuracy is a count out of 24 rows.
    assert all(round(v * 24, 6) == round(v * 24) for v in reporter.values.values())
    # The best checkpoint, loaded from disk: its accuracy on the 24 rows is the point it was saved at, and on all 96
    # rows the trial's value and its best_val_accuracy.
    assert result.best_step is not None and result.best_value is not None
    best = AutoModelForSequenceClassification.from_pretrained(tmp_path / "best")
    subset, everything = _score(best, data, rows.data(data.validation)), _score(best, data, data.validation)
    assert subset.accuracy == pytest.approx(reporter.values[result.best_step])
    assert everything.accuracy == pytest.approx(result.best_value)
    assert reporter.attrs[attrs.BEST_VAL + "accuracy"] == pytest.approx(result.best_value)
    assert round(result.best_value * 96, 6) == round(result.best_value * 96)
    assert any("re-scored on all 96 validation rows" in r.getMessage() for r in caplog.records)
    assert any("score 24 of the 96 validation rows" in r.getMessage() for r in caplog.records)


def test_rows_not_fewer_than_the_split_mean_every_row_and_say_so(
    tiny_model: Path, prepared: tuple[Any, Prepared], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok, data = prepared
    cfg = TrainConfig(batch_size=32, micro_batch_size=32, epochs=1, eval_every=5)  # 10 steps
    reporter = NullReporter()
    caplog.set_level(logging.INFO, "hpsearch.trainer.loop")
    fit(tiny_run(tiny_model, (tok, data), cfg, tmp_path, point_rows=PointRows(96)), reporter)
    assert "point_rows" not in reporter.attrs and "final_rows" not in reporter.attrs
    assert any("validation_rows 96: the validation split has 96 rows" in r.getMessage() for r in caplog.records)


DRAW = """
import json, sys
from hpsearch.trainer.points import PointRows
from hpsearch.trainer.tokenised import Encoded
split = Encoded(input_ids=[[i] for i in range(5000)])
print(json.dumps([row[0] for row in PointRows(int(sys.argv[1]), int(sys.argv[2])).data(split).input_ids]))
"""


def test_two_workers_draw_the_same_rows(tmp_path: Path) -> None:
    def draw(rows: int, seed: int, hash_seed: str) -> list[int]:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", DRAW, str(rows), str(seed)], capture_output=True, text=True, env=env, check=True
        )
        return json.loads(done.stdout)

    first, second = draw(300, 7, "1"), draw(300, 7, "2")
    assert first == second and len(set(first)) == 300 and first == sorted(first)
    assert draw(300, 8, "1") != first  # the study's split_seed picks them
    assert set(draw(100, 7, "3")) <= set(first)  # fewer rows: the first of the same draw


@pytest.mark.parametrize("value", [-1, 2.5, True, "100"])
def test_validation_rows_must_be_a_whole_number_of_rows(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"data\.validation_rows: .* must be a positive whole number of rows"):
        DataConfig(train="t.jsonl", validation="v.jsonl", validation_rows=value).validate()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("-5", "data.validation_rows: -5 must be a positive whole number of rows"),
        ("0.5", "data.validation_rows: 0.5 has the wrong type; expected an integer"),
    ],
)
def test_a_bad_validation_rows_stops_start_in_one_line(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], value: str, expected: str
) -> None:
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, *demo_files, n_trials=1)
    spec.write_text(text.replace("[data]\n", f"[data]\nvalidation_rows = {value}\n"))
    assert_refused(cli, spec, tmp_path, expected)
