"""A task's two splits read (sources.py, reading.py, task_rows.py, chat.py) and its labels fitted on the training
split: everything about the data that needs no tokenizer, so a `start` checks it cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpsearch.trainer.chat import ChatRows, read_chat_rows
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.labels import LabelMap
from hpsearch.trainer.reading import DataError, Rows, TextRows, read_rows, read_text_rows
from hpsearch.trainer.sources import Source, read
from hpsearch.trainer.task_names import CAUSAL_LM, CLASSIFICATION, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION
from hpsearch.trainer.task_rows import TaskRows, read_task_rows


@dataclass
class Splits:
    train: Rows | TaskRows | TextRows | ChatRows
    validation: Rows | TaskRows | TextRows | ChatRows
    labels: LabelMap | None
    """Every task but causal-lm: label value <-> class id (a regression's: its one output)."""


def read_splits(cfg: DataConfig, task: str = CLASSIFICATION) -> Splits:
    """Read both splits (sources.py) and check their labels agree; no tokenizer needed (cheap validation)."""
    train_source, validation_source = read(cfg, stratify=task == CLASSIFICATION)
    if task == CAUSAL_LM:
        return Splits(_read_lm(train_source, cfg), _read_lm(validation_source, cfg), None)
    if task == CLASSIFICATION and cfg.text_pair_column == "":
        train, validation = (
            read_rows(s.path, cfg.text_column, cfg.label_column, cfg.header, s.records)
            for s in (train_source, validation_source)
        )
        labels = LabelMap.fit(train.labels, train.path)
        labels.encode(validation.labels, validation.path)  # raises on a label unseen in training
        return Splits(train, validation, labels)
    train_rows, validation_rows = (
        read_task_rows(s.path, s.records, cfg, task) for s in (train_source, validation_source)
    )
    labels = fit_labels(train_rows, task, cfg)
    targets(validation_rows, labels)  # raises on a label unseen in training
    return Splits(train_rows, validation_rows, labels)


def fit_labels(rows: TaskRows, task: str, cfg: DataConfig) -> LabelMap:
    if task == REGRESSION:
        if len(set(rows.labels)) < 2:
            raise DataError(
                f"data.train: every row of {rows.path} has label {rows.labels[0]:g}; a regression needs labels that "
                "vary (a constant is learnt by the bias alone, and correlations with it are undefined)"
            )
        return LabelMap.of_regression(cfg.label_column)
    if task == MULTI_LABEL:
        return LabelMap.fit_sets(rows.labels, rows.path)
    if task == TOKEN_CLASSIFICATION:
        return LabelMap.fit_tags(rows.labels, rows.path)
    return LabelMap.fit(rows.labels, rows.path)


def targets(rows: TaskRows, labels: LabelMap) -> list[Any]:
    """What each row is trained to predict: a class id, [its number], a multi-hot row, or each word's tag id."""
    if labels.task == REGRESSION:
        return [[float(y)] for y in rows.labels]
    if labels.task == MULTI_LABEL:
        return labels.encode_sets(rows.labels, rows.lines, rows.path)
    if labels.task == TOKEN_CLASSIFICATION:
        return [labels.encode_tags(tags, line, rows.path) for tags, line in zip(rows.labels, rows.lines, strict=True)]
    return labels.encode(rows.labels, rows.path)


def _read_lm(source: Source, cfg: DataConfig) -> TextRows | ChatRows:
    """Chat rows when the split's first row holds ``messages_column``, else text or prompt/response rows."""
    path, records = source.path, source.records
    if cfg.messages_column in records[0][1]:
        return read_chat_rows(path, cfg.messages_column, records)
    return read_text_rows(path, cfg.text_column, cfg.prompt_column, cfg.response_column, cfg.header, records)
