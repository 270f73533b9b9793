"""Label values <-> class ids (a classifier's classes, a multi-label model's labels, a tagger's tags), fitted on the
training file; a regression's one output, named."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.trainer.reading import DataError, as_int, short
from hpsearch.trainer.task_names import CLASSIFICATION, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION

PROBLEM_TYPES = {
    CLASSIFICATION: "single_label_classification",
    REGRESSION: "regression",
    MULTI_LABEL: "multi_label_classification",
}
"""transformers' ``config.problem_type`` of each sequence task (a token classifier has none)."""


@dataclass(frozen=True)
class LabelMap:
    """Label value <-> class id, and the task they are labels of. Saved with every checkpoint (config.json's
    id2label) so predictions decode back."""

    names: tuple[str, ...]
    numeric: bool
    task: str = CLASSIFICATION

    @classmethod
    def of_regression(cls, column: object) -> LabelMap:
        """A regression's one output, named after the label column (id2label {0: "score"})."""
        return cls((str(column),), numeric=True, task=REGRESSION)

    @classmethod
    def fit_sets(cls, label_sets: Sequence[Sequence[str]], path: Path) -> LabelMap:
        """A multi-label model's labels: every label of the training rows, sorted into ids."""
        names = sorted({name for labels in label_sets for name in labels})
        if not names:
            raise DataError(
                f"data.train: every row of {path} has an empty label list; a multi-label model needs rows that have "
                "labels; fill data.label_column (a list, or labels cut at data.label_separator)"
            )
        return cls(tuple(names), numeric=False, task=MULTI_LABEL)

    @classmethod
    def fit_tags(cls, tag_lists: Sequence[Sequence[str]], path: Path) -> LabelMap:
        """A tagger's tags: every tag of the training rows, sorted into ids; one tag alone teaches nothing."""
        names = sorted({tag for tags in tag_lists for tag in tags})
        if len(names) < 2:
            raise DataError(
                f"data.train: every word of {path} has tag {short(repr(names[0] if names else ''))}; a tagger needs "
                "at least 2 tags (the entities' B-/I- tags and O); check data.label_column"
            )
        return cls(tuple(names), numeric=False, task=TOKEN_CLASSIFICATION)

    @property
    def problem_type(self) -> str | None:
        return PROBLEM_TYPES.get(self.task)

    def encode_sets(self, label_sets: Sequence[Sequence[str]], lines: Sequence[int], path: Path) -> list[list[float]]:
        """Multi-hot rows: 1.0 at each label's id."""
        index = {name: i for i, name in enumerate(self.names)}
        out = []
        for labels, line in zip(label_sets, lines, strict=True):
            row = [0.0] * len(self.names)
            for name in labels:
                if name not in index:
                    raise self._unseen(path, line, name)
                row[index[name]] = 1.0
            out.append(row)
        return out

    def encode_tags(self, tags: Sequence[str], line: int, path: Path) -> list[int]:
        index = {name: i for i, name in enumerate(self.names)}
        for tag in tags:
            if tag not in index:
                raise self._unseen(path, line, tag)
        return [index[tag] for tag in tags]

    def _unseen(self, path: Path, line: int, value: str) -> DataError:
        what = "tag" if self.task == TOKEN_CLASSIFICATION else "label"
        return DataError(
            f"data file {path}: line {line} has {what} {short(repr(value))}, never seen in the training data "
            f"({what}s: {short(', '.join(self.names), 120)}); fix the {what} or add it to training"
        )

    @classmethod
    def fit(cls, labels: Sequence[Any], path: Path) -> LabelMap:
        """The classes of the training labels. Integers must be consecutive (0..K-1, 1..K for star ratings,
        -1..1): class ids follow their order and id2label keeps the user's values; a gap or a stray large value
        is refused (it would make classes with no examples). Strings are sorted into ids."""
        ints = [as_int(v) for v in labels]
        distinct = sorted({i for i in ints if i is not None})
        numeric = len(distinct) > 0 and all(i is not None for i in ints)
        names = sorted({str(v) for v in labels})
        if len(names) < 2 or (numeric and len(distinct) < 2):  # "1" and "01" are one class
            raise DataError(
                f"data.train: every row of {path} has label {short(repr(labels[0]))}; a classifier needs at "
                "least 2 classes; add examples of the other classes"
            )
        if not numeric:
            return cls(tuple(names), numeric=False)
        lo, hi, k = distinct[0], distinct[-1], len(distinct)
        absent = hi - lo + 1 - k  # values between the smallest and largest with no example
        if absent:
            present = set(distinct)
            gaps = _listing([i for i in range(lo, hi + 1) if i not in present]) if absent <= 8 else f"{absent} values"
            raise DataError(
                f"data file {path}: integer labels are class ids and must be consecutive (0..K-1 or 1..K); got "
                f"{_listing(distinct)}, with no example of {gaps} between {lo} and {hi}; renumber them "
                f"0..{k - 1} or use string labels"
            )
        return cls(tuple(str(i) for i in distinct), numeric=True)

    @property
    def num_labels(self) -> int:
        return len(self.names)

    def encode(self, labels: Sequence[Any], path: Path) -> list[int]:
        index = {name: i for i, name in enumerate(self.names)}
        out = []
        for row, value in enumerate(labels, start=1):
            key = str(as_int(value)) if self.numeric and as_int(value) is not None else str(value)
            if key not in index:
                raise DataError(
                    f"data file {path}: example {row} has label {value!r}, never seen in the "
                    f"training data (labels: {', '.join(self.names[:10])}); fix the label or add "
                    "it to training"
                )
            out.append(index[key])
        return out

    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))


def _listing(values: Sequence[int], head: int = 8) -> str:
    """``0, 1, 2, ..., 9 (12 values)``: enough to see the problem without flooding one line."""
    shown = [short(str(v), 20) for v in values]
    if len(shown) <= head:
        return ", ".join(shown)
    return f"{', '.join(shown[: head - 2])}, ..., {', '.join(shown[-2:])} ({len(shown)} values)"
