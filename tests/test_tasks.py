"""Regression, multi-label, token classification and sentence pairs (issue 59): each metric against a hand
computation on fixed predictions, each task trained for real through the CLI on a tiny BERT, its best checkpoint
reloaded with plain transformers to the recorded metric, and bad labels refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import torch

from hpsearch.search.workers.early_stop import ChanceLevel
from hpsearch.trainer import meta_model
from hpsearch.trainer.checkpoint import META
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.evaluate import Metrics, evaluate
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.splits import read_splits
from hpsearch.trainer.task_names import IGNORE_INDEX, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION
from hpsearch.trainer.tokenised import Encoded
from tests.conftest import Cli, assert_refused, hpsearch, one_trial
from tests.support.task_data import (
    multi_label_rows,
    pair_rows,
    regression_rows,
    token_rows,
    write_conll,
    write_jsonl,
)

CPU = torch.device("cpu")


class FixedLogits(torch.nn.Module):
    """A model whose logits are read off its input ids (``table[id]``): fixed predictions to score by hand. Sequence
    tasks read the first token's row; a tagger every token's."""

    def __init__(self, table: torch.Tensor, per_token: bool = False) -> None:
        super().__init__()
        self.table, self.per_token = table, per_token

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return SimpleNamespace(logits=self.table[input_ids] if self.per_token else self.table[input_ids[:, 0]])


def _score(model: torch.nn.Module, data: Encoded, num_labels: int = 0, tags: tuple[str, ...] = ()) -> Any:
    # batch_size 2: the sums cross several batches, as they do over a real split.
    return evaluate(model, data, pad_id=0, batch_size=2, device=CPU, precision="fp32", num_labels=num_labels, tags=tags)


def test_regression_metrics_match_a_hand_computation_and_scipy() -> None:
    from scipy import stats

    predicted = [0.5, 2.0, 2.0, 3.5, 1.0]
    true = [1.0, 2.0, 3.0, 3.0, 0.0]
    table = torch.zeros(20, 1)
    table[10:15, 0] = torch.tensor(predicted)
    data = Encoded(input_ids=[[10 + i, 1] for i in range(5)], task=REGRESSION, scores=[[y] for y in true])
    metrics = _score(FixedLogits(table), data)
    assert metrics.loss == pytest.approx((0.25 + 0 + 1 + 0.25 + 1) / 5)  # mean squared error
    assert metrics.pearson == pytest.approx(stats.pearsonr(predicted, true)[0])
    # Tied predictions (2.0, 2.0) and tied labels (3.0, 3.0) share their mean rank, as in scipy.
    assert metrics.spearman == pytest.approx(stats.spearmanr(predicted, true)[0])
    # By hand: ranks (1, 3.5, 3.5, 5, 2) and (2, 3, 4.5, 4.5, 1), both of mean 3: 7.75 / sqrt(9.5 x 9.5).
    assert metrics.spearman == pytest.approx(7.75 / 9.5)
    assert set(metrics.values()) == {"loss", "pearson", "spearman"}


def test_multi_label_metrics_match_a_hand_computation() -> None:
    true = [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]]
    predicted = [[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 0]]
    table = torch.zeros(20, 3)
    for i, row in enumerate(predicted):  # logit +2 (sigmoid 0.88 > 0.5): predicted; -2: not
        table[10 + i] = torch.tensor([2.0 if p else -2.0 for p in row])
    data = Encoded(input_ids=[[10 + i] for i in range(4)], task=MULTI_LABEL, scores=[list(map(float, r)) for r in true])
    metrics = _score(FixedLogits(table), data, num_labels=3)
    # Label 0: tp 2; label 1: tp 1, fn 1; label 2: fp 1, fn 1. Micro: tp 3, fp 1, fn 2.
    assert metrics.f1 == pytest.approx(2 * 3 / (2 * 3 + 1 + 2))
    assert metrics.macro_f1 == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert metrics.accuracy == pytest.approx(2 / 4)  # rows 1 and 3 exactly right
    wrong, right = math.log1p(math.exp(2)), math.log1p(math.exp(-2))
    assert metrics.loss == pytest.approx((3 * wrong + 9 * right) / 12)  # BCE per label and row


def test_token_metrics_are_seqevals_on_its_own_example() -> None:
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    # seqeval's README example: f1 0.50, accuracy 0.80.
    y_true = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    y_pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    tags = ("B-MISC", "B-PER", "I-MISC", "I-PER", "O")
    table = torch.zeros(20, len(tags))
    table[:10, tags.index("B-PER")] = 1.0  # special tokens and later sub-tokens: predicted B-PER, never scored
    for k in range(len(tags)):
        table[10 + k, k] = 1.0
    input_ids, token_labels = [], []
    for truth, guess in zip(y_true, y_pred, strict=True):
        # [CLS], each word's first sub-token (its id says the prediction), one more sub-token of the first word, [SEP]
        ids = [2] + [10 + tags.index(g) for g in guess] + [5, 3]
        labels = [IGNORE_INDEX] + [tags.index(t) for t in truth] + [IGNORE_INDEX, IGNORE_INDEX]
        input_ids.append(ids)
        token_labels.append(labels)
    data = Encoded(input_ids=input_ids, token_labels=token_labels, task=TOKEN_CLASSIFICATION)
    metrics = _score(FixedLogits(table, per_token=True), data, tags=tags)
    assert metrics.f1 == pytest.approx(0.5) and metrics.f1 == pytest.approx(f1_score(y_true, y_pred))
    assert metrics.precision == pytest.approx(precision_score(y_true, y_pred)) == pytest.approx(0.5)
    assert metrics.recall == pytest.approx(recall_score(y_true, y_pred)) == pytest.approx(0.5)
    assert metrics.accuracy == pytest.approx(accuracy_score(y_true, y_pred)) == pytest.approx(0.8)


def test_chance_priors_per_task() -> None:
    regression = Encoded(input_ids=[[1]] * 4, task=REGRESSION, scores=[[1.0], [2.0], [3.0], [6.0]])
    prior = ChanceLevel.of_split(regression)
    assert prior is not None and prior.loss == pytest.approx(3.5) and prior.accuracy is None  # the variance
    # The loss alone is judged: an MSE at the variance or above is no better than predicting the mean.
    assert prior.matches(Metrics(loss=3.6, pearson=0.9)) and not prior.matches(Metrics(loss=3.4, pearson=0.0))
    assert not prior.matches(Metrics(loss=float("nan"))) and not prior.not_yet_seen(Metrics(loss=1.0))
    multi = Encoded(input_ids=[[1]] * 4, task=MULTI_LABEL, scores=[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    prior = ChanceLevel.of_split(multi)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # each label present in a quarter of the rows
    assert prior is not None and prior.loss == pytest.approx(h)
    tagged = Encoded(input_ids=[[1, 2, 3]], token_labels=[[IGNORE_INDEX, 0, 1]], task=TOKEN_CLASSIFICATION)
    prior = ChanceLevel.of_split(tagged)
    assert prior is not None and prior.loss == pytest.approx(math.log(2)) and prior.accuracy == 0.5
    assert ChanceLevel.of_split(Encoded(input_ids=[[1]], task="causal-lm")) is None


def test_memory_plan_builds_each_tasks_model(tiny_model: Path) -> None:
    token, _ = meta_model.meta_model(str(tiny_model), TOKEN_CLASSIFICATION, 5)
    regression, _ = meta_model.meta_model(str(tiny_model), REGRESSION, 1)
    assert type(token).__name__ == "BertForTokenClassification"
    assert type(regression).__name__ == "BertForSequenceClassification"


# --- reading and encoding


def test_words_are_tagged_on_their_first_sub_token(tiny_model: Path, tmp_path: Path) -> None:
    rows = [{"tokens": ["the", "cast,", "superb"], "tags": ["B-SUBJ", "I-SUBJ", "O"]}] * 2
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = DataConfig(str(train), str(train), text_column="tokens", label_column="tags")
    tokenizer = load_tokenizer(str(tiny_model))
    data = prepare(cfg, tokenizer, 32, None, TOKEN_CLASSIFICATION)
    assert data.labels is not None and data.labels.names == ("B-SUBJ", "I-SUBJ", "O")
    ids, labels = data.train.input_ids[0], data.train.token_labels[0]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "the", "cast", ",", "superb", "[SEP]"]
    assert labels == [IGNORE_INDEX, 0, 1, IGNORE_INDEX, 2, IGNORE_INDEX]  # "cast," is two sub-tokens: one tagged
    assert data.train.targets([0, 1]) == 6  # three words a row


def test_conll_and_word_list_rows_read_alike(tmp_path: Path) -> None:
    rows = token_rows(20, 1)
    conll = write_conll(tmp_path / "t.conll", rows)
    listed = write_jsonl(tmp_path / "t.jsonl", rows)
    from_conll = read_splits(DataConfig(str(conll), str(conll)), TOKEN_CLASSIFICATION)
    from_lists = read_splits(
        DataConfig(str(listed), str(listed), text_column="tokens", label_column="tags"), TOKEN_CLASSIFICATION
    )
    assert from_conll.train.texts == from_lists.train.texts == [r["tokens"] for r in rows]  # type: ignore[union-attr]
    assert from_conll.labels == from_lists.labels


def test_sentence_pairs_carry_their_segments(tiny_model: Path, tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "p.jsonl", pair_rows(8, 1))
    cfg = DataConfig(str(train), str(train), text_pair_column="text2")
    tokenizer = load_tokenizer(str(tiny_model))
    data = prepare(cfg, tokenizer, 64, None)
    row = pair_rows(8, 1)[0]
    assert data.train.input_ids[0] == tokenizer(row["text"], row["text2"])["input_ids"]
    types = data.train.token_type_ids[0]
    assert types[0] == 0 and types[-1] == 1 and sorted(set(types)) == [0, 1]  # the second sentence is segment 1


def test_multi_label_reads_lists_and_separated_strings(tmp_path: Path) -> None:
    train = tmp_path / "m.csv"
    train.write_text(
        'text,topics\nthe plot was dull,criticism\nthe cast was superb but dull,praise|criticism\n"so so",\n'
    )
    splits = read_splits(DataConfig(str(train), str(train), label_column="topics", label_separator="|"), MULTI_LABEL)
    assert splits.labels is not None and splits.labels.names == ("criticism", "praise")
    assert splits.train.labels == [["criticism"], ["praise", "criticism"], []]  # type: ignore[union-attr]


# --- bad labels: one line, exit 2, nothing written

BAD: list[tuple[str, str, list[dict[str, Any]], str, str]] = [
    (
        "regression",
        'label_column = "score"',
        [{"text": "the plot was dull", "score": 1.0}, {"text": "the cast was superb", "score": "high"}],
        "pearson",
        "line 2: label \"high\" in column 'score' is not a finite number; a regression's labels are numbers",
    ),
    (
        "multi-label",
        'label_column = "labels"',
        [{"text": "the plot was dull", "labels": ["criticism"]}, {"text": "the cast", "labels": "praise,contrast"}],
        "f1",
        "line 2: label \"praise,contrast\" in column 'labels' is one string; a multi-label row's labels are a list",
    ),
    (
        "token-classification",
        'text_column = "tokens"\nlabel_column = "tags"',
        [{"tokens": ["the", "plot"], "tags": ["B-SUBJ", "I-SUBJ"]}, {"tokens": ["the", "plot"], "tags": ["O"]}],
        "f1",
        "line 2: 2 words in 'tokens' but 1 tags in 'tags'; give each word one tag",
    ),
]


@pytest.mark.parametrize(("task", "columns", "rows", "metric", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_labels_are_refused_with_the_row_and_the_fix(
    cli: Cli, tmp_path: Path, tiny_model: Path, task: str, columns: str, rows: list[Any], metric: str, expected: str
) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    spec = tmp_path / "s.toml"
    spec.write_text(_spec(tiny_model, task, data, data, columns=columns, metric=metric))
    assert_refused(cli, spec, tmp_path, expected)


def test_unseen_validation_tag_and_bad_conll_line_are_refused(cli: Cli, tmp_path: Path, tiny_model: Path) -> None:
    train = write_conll(tmp_path / "train.conll", token_rows(20, 1))
    dev = tmp_path / "dev.conll"
    dev.write_text("the\tB-SUBJ\nplot\tB-LOC\n")
    spec = tmp_path / "s.toml"
    spec.write_text(_spec(tiny_model, "token-classification", train, dev))
    assert_refused(cli, spec, tmp_path, "dev.conll: line 1 has tag 'B-LOC', never seen in the training data")
    dev.write_text("the\tB-SUBJ\nplot\n")
    assert_refused(cli, spec, tmp_path, "dev.conll: line 2 has one field ('plot'); a CoNLL line is a token and its tag")


def test_a_metric_the_task_does_not_record_is_refused(cli: Cli, tmp_path: Path, tiny_model: Path) -> None:
    data = write_jsonl(tmp_path / "r.jsonl", regression_rows(16, 1))
    spec = tmp_path / "s.toml"
    spec.write_text(_spec(tiny_model, "regression", data, data, columns='label_column = "score"', metric="accuracy"))
    assert_refused(
        cli, spec, tmp_path, "search.metric: 'accuracy' is not recorded for model.task = 'regression'; use one of loss"
    )


# --- each task through the CLI, its best checkpoint loaded with plain transformers


def _spec(  # the tiny BERT barely learns in 6 steps: no chance stop (tested in test_chance_priors_per_task)
    model: Path,
    task: str,
    train: Path,
    dev: Path,
    *,
    columns: str = "",
    metric: str = "f1",
    extra: str = "",
    n_trials: int = 1,
) -> str:
    return f"""
[model]
name = "{model}"
task = "{task}"
max_length = 48
[data]
train = "{train}"
validation = "{dev}"
{columns}
[train]
batch_size = 16
micro_batch_size = 8
epochs = 1
eval_every = 3
precision = "fp32"
resume_every_minutes = 0
{extra}
[search]
n_trials = {n_trials}
sampler = "random"
pruner = "median"
metric = "{metric}"
early_points = false
prune_at_chance = 0
[[search.enqueue]]
learning_rate = 3e-3
[search.space]
learning_rate = {{ type = "float", low = 1e-4, high = 1e-2, log = true }}
"""


def _best(study: str, url: str, root: Path, *export: str) -> dict[str, Any]:
    result = hpsearch("best", "--study", study, "--storage", url, "--json", *export, cwd=root)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def _rescore(folder: Path, auto: Any, cfg: DataConfig, task: str, load: Any = None, **values: float) -> Any:
    """The checkpoint in ``folder``, loaded with ``auto`` (plain transformers or peft, with ``load``'s arguments),
    scored on the validation split: each of ``values`` (what the study recorded) must come back."""
    model = auto.from_pretrained(folder, **(load or {}))
    data = prepare(cfg, load_tokenizer(str(folder)), 48, None, task)
    tags = data.labels.names if data.labels is not None and task == TOKEN_CLASSIFICATION else ()
    num_labels = data.labels.num_labels if data.labels is not None else 0
    metrics = evaluate(
        model, data.validation, pad_id=0, batch_size=16, device=CPU, precision="fp32", num_labels=num_labels, tags=tags
    )
    for name, value in values.items():
        assert metrics.values()[name] == pytest.approx(value, abs=1e-5), name
    return model


def test_regression_of_sentence_pairs_searched_on_pearson(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    train = write_jsonl(tmp_path / "train.jsonl", pair_rows(96, 1))
    dev = write_jsonl(tmp_path / "dev.jsonl", pair_rows(48, 2))
    columns = 'text_pair_column = "text2"\nlabel_column = "score"'
    spec = tmp_path / "s.toml"
    spec.write_text(_spec(tiny_model, "regression", train, dev, columns=columns, metric="pearson"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("reg", spec, url, tmp_path)
    assert sorted(trial.intermediate_values) == [3, 6]  # 96 / 16 = 6 steps
    assert trial.value == max(trial.intermediate_values.values()) == trial.user_attrs["best_val_pearson"]
    assert -1 <= trial.value <= 1 and "best_val_spearman" in trial.user_attrs
    folder = Path(_best("reg", url, tmp_path)["best_checkpoint"])
    cfg = DataConfig(str(train), str(dev), label_column="score", text_pair_column="text2")
    model = _rescore(
        folder,
        AutoModelForSequenceClassification,
        cfg,
        REGRESSION,
        pearson=trial.value,
        loss=trial.user_attrs["best_val_loss"],
    )
    assert model.config.problem_type == "regression" and model.config.num_labels == 1
    assert model.config.id2label == {0: "score"}


def test_multi_label_searched_on_micro_f1(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    train = write_jsonl(tmp_path / "train.jsonl", multi_label_rows(96, 1))
    dev = write_jsonl(tmp_path / "dev.jsonl", multi_label_rows(48, 2))
    spec = tmp_path / "s.toml"
    spec.write_text(_spec(tiny_model, "multi-label", train, dev, columns='label_column = "labels"', metric="f1"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("ml", spec, url, tmp_path)
    assert trial.value == trial.user_attrs["best_val_f1"] and trial.value > 0
    assert {"best_val_macro_f1", "best_val_accuracy"} <= set(trial.user_attrs)
    folder = Path(_best("ml", url, tmp_path)["best_checkpoint"])
    cfg = DataConfig(str(train), str(dev), label_column="labels")
    model = _rescore(
        folder,
        AutoModelForSequenceClassification,
        cfg,
        MULTI_LABEL,
        f1=trial.value,
        macro_f1=trial.user_attrs["best_val_macro_f1"],
    )
    assert model.config.problem_type == "multi_label_classification"
    assert model.config.id2label == {0: "contrast", 1: "criticism", 2: "praise"}


def test_token_classification_from_conll_with_lora_and_a_merged_export(tmp_path: Path, tiny_model: Path) -> None:
    from peft import AutoPeftModelForTokenClassification
    from transformers import AutoModelForTokenClassification

    train = write_conll(tmp_path / "train.conll", token_rows(96, 1))
    dev = write_conll(tmp_path / "dev.conll", token_rows(48, 2))
    spec = tmp_path / "s.toml"
    lora = '[adapter]\nmethod = "lora"\nr = 4'
    spec.write_text(_spec(tiny_model, "token-classification", train, dev, metric="f1") + lora)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("ner", spec, url, tmp_path)
    assert trial.value == trial.user_attrs["best_val_f1"]
    assert {"best_val_precision", "best_val_recall", "best_val_accuracy"} <= set(trial.user_attrs)
    folder = Path(_best("ner", url, tmp_path)["best_checkpoint"])
    assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "TOKEN_CLS"
    cfg = DataConfig(str(train), str(dev))
    # An adapter loads on its base, whose head has the base's label count: peft's loader is told the tagger's.
    five = {"num_labels": 5, "ignore_mismatched_sizes": True}
    adapter = _rescore(folder, AutoPeftModelForTokenClassification, cfg, TOKEN_CLASSIFICATION, five, f1=trial.value)
    assert adapter.active_peft_config.task_type == "TOKEN_CLS"
    # An adapter folder holds no config.json: its tags are in hpsearch.json, and in a merged export's config.
    tags = {"0": "B-NEG", "1": "B-POS", "2": "B-SUBJ", "3": "I-SUBJ", "4": "O"}
    assert json.loads((folder / META).read_text())["id2label"] == tags
    merged = tmp_path / "merged"
    _best("ner", url, tmp_path, "--export", str(merged), "--merge")
    model = _rescore(merged, AutoModelForTokenClassification, cfg, TOKEN_CLASSIFICATION, f1=trial.value)
    assert model.config.id2label == {int(k): v for k, v in tags.items()}
    assert optuna.load_study(study_name="ner", storage=url).best_trial.number == trial.number
