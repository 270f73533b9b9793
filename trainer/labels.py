"""Label values <-> class ids for classification, fitted on the training file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.trainer.reading import DataError, as_int, short


@dataclass(frozen=True)
class LabelMap:
    """Label value <-> class id. Saved with every checkpoint so predictions decode back."""

    names: tuple[str, ...]
    numeric: bool

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
