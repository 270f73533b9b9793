"""Chance level: of a validation split, of a validation point, and a run stopped at it."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import optuna
import pytest

from hpsearch.search.workers.early_stop import ChanceLevel, EarlyStop, PruningGate
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.evaluate import Metrics
from hpsearch.trainer.loop import fit
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.report import TrainResult
from tests.conftest import hpsearch, spec_text
from tests.support import deleted
from tests.support.tiny import tiny_run


def test_chance_of_labels() -> None:
    chance = ChanceLevel.of([1] * 147 + [0] * 109)  # seed 2's SST-2 validation subset in search_vs_hf
    assert chance is not None
    assert chance.accuracy == pytest.approx(147 / 256)
    assert chance.loss == pytest.approx(0.68209, abs=1e-5)
    assert chance.margin == pytest.approx(math.sqrt(0.5742 * 0.4258 / 256), abs=1e-4)
    assert ChanceLevel.of([]) is None
    three = ChanceLevel.of([0, 1, 2] * 10)
    assert three is not None and three.loss == pytest.approx(math.log(3))


# Points measured on that subset with MiniLM (loss, accuracy).
@pytest.mark.parametrize(
    "loss,accuracy,expected",
    [
        (0.6903, 0.5781, True),  # lr 8e-6: the prior and nothing else
        (0.6937, 0.4258, True),  # lr 1e-3, diverged: flips between the two labels
        (0.6746, 0.5742, False),  # lr 4e-5 just out of warm-up: majority label, but the loss is falling
        (0.6867, 0.8047, False),  # lr 6e-4: over-confident, loss above the prior, accuracy far above it
        (float("nan"), 0.5742, False),  # NaN is the NaN check's business
    ],
)
def test_a_point_matches_chance_only_when_loss_and_accuracy_both_say_so(
    loss: float, accuracy: float, expected: bool
) -> None:
    chance = ChanceLevel.of([1] * 147 + [0] * 109)
    assert chance is not None
    assert chance.matches(Metrics(loss=loss, accuracy=accuracy, f1=0.0)) is expected


def test_causal_lm_points_never_match() -> None:
    chance = ChanceLevel.of([0, 1])
    assert chance is not None and not chance.matches(Metrics(loss=9.0, perplexity=math.exp(9.0)))


# -- in the training loop and in a search, for real ---------------------------------------------


@pytest.fixture(scope="module")
def words_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A split the tiny BERT learns within a few steps at lr 1e-2 (it learns nothing of the
    demo data in the steps a test can afford): the label is in every word."""
    folder = tmp_path_factory.mktemp("words")
    rng = random.Random(0)
    paths = []
    for name, n in (("train", 256), ("dev", 64)):
        path = folder / f"{name}.jsonl"
        with path.open("w") as f:
            for _ in range(n):
                positive = rng.random() < 0.5
                words = rng.choices(["good", "great", "fine"] if positive else ["bad", "terrible"], k=3)
                f.write(json.dumps({"text": " ".join(words), "label": "positive" if positive else "negative"}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def _fit(model_dir: Path, files: tuple[Path, Path], cfg: TrainConfig, out: Path, prune_at_chance: int) -> TrainResult:
    tok = load_tokenizer(str(model_dir))
    data = prepare(DataConfig(train=str(files[0]), validation=str(files[1])), tok, 32, None)
    # The search's early stop around the reporter, as a worker sets it up (no pruner: it never prunes).
    gate = PruningGate.of_run(data, cfg, "loss", prune_at_chance=prune_at_chance, patient=True)
    early = EarlyStop(NullReporter(), gate)
    result = fit(tiny_run(model_dir, (tok, data), cfg, out), early)
    result.fail_reason = result.fail_reason or early.reason
    return result


def test_a_run_that_does_not_learn_stops_at_the_second_judged_point(
    tiny_model: Path, words_files: tuple[Path, Path], tmp_path: Path
) -> None:
    # lr 1e-9 leaves the random head predicting the prior. 16 steps, warm-up 0.3 = 5 steps:
    # judged from step 5 (warm-up; a fifth would be 4), so at 6 and 8: stopped at 8.
    cfg = TrainConfig(learning_rate=1e-9, batch_size=32, micro_batch_size=32, epochs=2, eval_every=2, warmup_ratio=0.3)
    result = _fit(tiny_model, words_files, cfg, tmp_path / "flat", prune_at_chance=2)
    assert (result.status, result.fail_reason, result.steps) == ("pruned", "at_chance", 8)
    # Off (what a plain fine-tune or pruner "none" gets), the same run trains to its end.
    result = _fit(tiny_model, words_files, cfg, tmp_path / "off", prune_at_chance=0)
    assert (result.status, result.steps) == ("complete", 16)


def test_a_learning_run_is_not_stopped(tiny_model: Path, words_files: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = TrainConfig(learning_rate=1e-2, batch_size=32, micro_batch_size=32, epochs=2, eval_every=2)
    result = _fit(tiny_model, words_files, cfg, tmp_path / "learns", prune_at_chance=1)
    assert (result.status, result.steps) == ("complete", 16)
    assert result.best_value is not None and result.best_value < 0.3


def test_a_search_records_why_a_trial_stopped(tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path) -> None:
    # The tiny model learns nothing of the demo data in these steps: every trial is at chance.
    spec = tmp_path / "chance.toml"
    spec.write_text(
        spec_text(tiny_model, *demo_files, n_trials=2, prune_at_chance=2).replace("eval_every = 5", "eval_every = 2")
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch(
        *("start", "--study", "c", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # no trial completed: no model came out
    study = optuna.load_study(study_name="c", storage=url)
    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    for t in trials:
        assert t.user_attrs["fail_reason"] == "at_chance"
        assert max(t.intermediate_values) < 20  # 20 steps in all
        assert t.user_attrs["best_checkpoint"].endswith(f"trial-{t.number}/best")
        assert deleted.why(study, t.number) == "trial pruned"


# -- when the pruner is asked (search/workers/early_stop.py) --------------------------------------------------


def _judge(metric: str = "accuracy", patient: bool = True) -> PruningGate:
    # Seed 9's validation subset in search_vs_hf (135 of 256 positive); 128 steps, warm-up 16.
    return PruningGate(ChanceLevel.of([1] * 135 + [0] * 121), 16, 128, metric, patient=patient)


@pytest.mark.parametrize(
    "step,loss,accuracy,asked",
    [
        (8, 0.6917, 0.5742, False),  # inside the warm-up
        (16, 0.6876, 0.5273, False),  # lr 5e-5: learnt the prior, predicts the majority label
        (32, 0.6876, 0.5273, True),  # the same, past a fifth of the run: judged
        (16, 0.6917, 0.5742, True),  # lr 1.5e-6: an untrained random head, lucky accuracy
        (16, 0.7450, 0.5273, True),  # lr 6e-4: loss above the prior's
        (16, 0.6467, 0.6211, True),  # accuracy out of the chance band
    ],
)
def test_the_pruner_is_asked_only_about_telling_points(step: int, loss: float, accuracy: float, asked: bool) -> None:
    assert _judge().may_prune(step, Metrics(loss=loss, accuracy=accuracy, f1=0.0)) is asked


def test_an_impatient_judge_or_a_loss_objective_asks_after_the_warmup() -> None:
    learnt_prior = Metrics(loss=0.6876, accuracy=0.5273, f1=0.3453)
    assert _judge(metric="loss").may_prune(16, learnt_prior)
    assert not _judge(metric="loss").may_prune(8, learnt_prior)
    assert _judge(patient=False).may_prune(8, learnt_prior)
    assert PruningGate(None, 0, 20, "loss", patient=True).may_prune(2, Metrics(loss=3.0, perplexity=20.0))
