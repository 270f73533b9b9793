"""Rows of the tasks beyond one text and one class: sentence pairs, regression's numbers, multi-label's label lists,
a tagger's words and tags (a row's list, or a CoNLL file: trainer/conll.py). Every refusal names the file, the line,
what is wrong and the fix. Plain classification reads its rows in trainer/reading.py (``read_rows``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.trainer.batching import CLASSIFICATION, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.reading import (
    Column,
    DataError,
    Records,
    _check_columns,
    _check_label_type,
    _missing,
    short,
)


@dataclass(frozen=True)
class TaskRows:
    texts: list[Any]
    """Each row's text; token-classification: its words."""
    labels: list[Any]
    """A class label (classification), a float (regression), a list of labels (multi-label), a tag a word."""
    path: Path
    lines: list[int]
    pairs: list[str] | None = None
    """data.text_pair_column's text of each row, where one is set."""


def read_task_rows(path: Path, records: Records, cfg: DataConfig, task: str) -> TaskRows:
    """``records`` (a split's rows as trainer/sources.py read them from ``path``) checked into the task's rows."""
    keys: dict[str, Column] = {"text_column": cfg.text_column, "label_column": cfg.label_column}
    if cfg.text_pair_column != "":
        keys["text_pair_column"] = cfg.text_pair_column
    _check_columns(path, cfg.header, keys, records)
    texts: list[Any] = []
    labels: list[Any] = []
    pairs: list[str] = []
    lines: list[int] = []
    for line_no, record in records:
        for key, column in keys.items():
            if column not in record:
                _missing(path, line_no, record, column, key, cfg.header, first=records[0][0] == line_no)
        where = f"data file {path}: line {line_no}"
        label = record[cfg.label_column]
        if task == TOKEN_CLASSIFICATION:
            words = _strings(record[cfg.text_column], f"{where}: {cfg.text_column!r}", "words")
            tags = _strings(label, f"{where}: {cfg.label_column!r}", "tags")
            if len(words) != len(tags):
                raise DataError(
                    f"{where}: {len(words)} words in {cfg.text_column!r} but {len(tags)} tags in "
                    f"{cfg.label_column!r}; give each word one tag"
                )
            texts.append(words)
            labels.append(tags)
        else:
            texts.append(_text(record[cfg.text_column], where, cfg.text_column))
            if cfg.text_pair_column != "":
                pairs.append(_text(record[cfg.text_pair_column], where, cfg.text_pair_column))
            labels.append(_label(label, task, path, line_no, cfg))
        lines.append(line_no)
    return TaskRows(texts, labels, path, lines, pairs if cfg.text_pair_column != "" else None)


def _text(value: Any, where: str, column: Column) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {column!r} must be text, got {short(json.dumps(value))}")
    if not value.strip():
        raise DataError(f"{where}: the text in column {column!r} is empty; fill it or remove the row")
    return value


def _strings(value: Any, where: str, what: str) -> list[str]:
    """A tagger's words or tags: a non-empty JSON list of non-blank strings."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f'{where} must be a non-empty list of {what} (["EU", "rejects", ...]), got {short(json.dumps(value))}; '
            "token-classification rows hold a word list and a tag list (or use a .conll file)"
        )
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise DataError(
                f"{where}: {short(json.dumps(item))} is not a {what[:-1]}; every item must be non-blank text"
            )
    return value


def _label(value: Any, task: str, path: Path, line_no: int, cfg: DataConfig) -> Any:
    column, where = cfg.label_column, f"data file {path}: line {line_no}"
    if task == CLASSIFICATION:  # as trainer/reading.py's read_rows checks them
        if value == "":
            raise DataError(f"{where}: empty label in column {column!r}")
        _check_label_type(value, path, line_no, column)
        return value
    if task == REGRESSION:
        return _number(value, where, column)
    if task == MULTI_LABEL:
        return _label_list(value, where, cfg)
    raise ValueError(f"no rows for task {task!r}")


def _number(value: Any, where: str, column: Column) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise DataError(
            f"{where}: label {short(json.dumps(value))} in column {column!r} is not a finite number; a regression's "
            "labels are numbers (3, 4.5); fix the label or remove the row"
        )
    return number


def _label_list(value: Any, where: str, cfg: DataConfig) -> list[str]:
    column, separator = cfg.label_column, cfg.label_separator
    if isinstance(value, str) and separator:
        return [part.strip() for part in value.split(separator) if part.strip()]  # "" is a row with no labels
    if isinstance(value, str):
        raise DataError(
            f"{where}: label {short(json.dumps(value))} in column {column!r} is one string; a multi-label row's "
            'labels are a list (["sports", "politics"]), or a string cut at data.label_separator: set it ("|", ",")'
        )
    if not isinstance(value, list):
        raise DataError(
            f"{where}: label {short(json.dumps(value))} in column {column!r} is not a list of labels; write "
            '["sports", "politics"] (or [] for none)'
        )
    names = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int)) or str(item).strip() == "":
            raise DataError(
                f"{where}: label list {short(json.dumps(value))} in column {column!r} holds "
                f"{short(json.dumps(item))}; its items must be label names (strings) or integers"
            )
        names.append(str(item))
    return names
