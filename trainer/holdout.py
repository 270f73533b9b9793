"""The validation rows held out of the training rows (``data.validation_fraction``): the same rows on every worker of
every host, as a function of the rows (in file order), the fraction and ``data.split_seed`` alone (the spec that
holds them is stored with the study)."""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from hpsearch.trainer.reading import Column, DataError, Records, as_int


def hold_out(records: Records, fraction: float, seed: int, label: Column | None, path: Path) -> tuple[Records, Records]:
    """(training rows, validation rows): ``fraction`` of ``records`` held out, each in file order. With ``label``
    (classification) the share is taken from every class alike (stratified), and a class keeps at least one training
    row: a validation label unseen in training is refused."""
    groups: dict[str, list[int]] = defaultdict(list)
    classes: dict[tuple[type, Any], str] = {}  # a label's class, worked out once per distinct value
    for i, (_, record) in enumerate(records):
        value = record.get(label) if label is not None else None
        try:
            key = classes.setdefault((type(value), value), _class(value))
        except TypeError:  # a list or an object: refused when the labels are read
            key = _class(value)
        groups[key].append(i)
    quotas = _quotas({key: len(rows) for key, rows in groups.items()}, fraction)
    # A draw per row in file order from Random(seed).random(), whose sequence Python guarantees across versions and
    # platforms (random.shuffle and sample are not); the smallest draws of each class are held out.
    rng = random.Random(seed)
    draws = [rng.random() for _ in records]
    held: set[int] = set()
    for key, rows in groups.items():
        held.update(heapq.nsmallest(quotas[key], rows, key=draws.__getitem__))
    if not held or len(held) == len(records):
        raise DataError(
            f"data file {path}: data.validation_fraction {fraction:g} of its {len(records)} rows leaves "
            f"{'no validation' if not held else 'no training'} rows; give a fraction that holds out at least one "
            "row and keeps one, or a data.validation file"
        )
    kept = [r for i, r in enumerate(records) if i not in held]
    return kept, [r for i, r in enumerate(records) if i in held]


def _class(value: Any) -> str:
    number = as_int(value)
    return str(number) if number is not None else repr(value)


def _quotas(sizes: dict[str, int], fraction: float) -> dict[str, int]:
    """Rows to hold out of each class: round(fraction x total) in all, shared by largest remainder, never a class's
    last row."""
    total = round(fraction * sum(sizes.values()))
    exact = {key: fraction * n for key, n in sizes.items()}
    quotas = {key: min(math.floor(x), max(sizes[key] - 1, 0)) for key, x in exact.items()}
    for key in sorted(exact, key=lambda k: (quotas[k] - exact[k], k)):  # the largest remainders first
        if sum(quotas.values()) >= total:
            break
        if quotas[key] < sizes[key] - 1:
            quotas[key] += 1
    return quotas


def drawn_rows(total: int, count: int, seed: int) -> list[int]:
    """``count`` of ``total`` row indices, in order, a function of the three alone (``data.validation_rows``'s rows:
    the same on every worker of every host): the smallest of a draw per row from Random(seed).random(), as
    :func:`hold_out` draws."""
    rng = random.Random(seed)
    draws = [rng.random() for _ in range(total)]
    return sorted(heapq.nsmallest(count, range(total), key=draws.__getitem__))
