"""Entity-level counts of a tagger's predictions, as seqeval computes them (its default, conlleval-compatible mode:
an entity is a maximal B-/I- span of one type, and a stray I- starts one), so hpsearch's f1, precision and recall
are seqeval's micro averages: summed over rows (and data-parallel ranks) before they are divided."""

from __future__ import annotations

from collections.abc import Sequence


def counts(true: Sequence[str], predicted: Sequence[str]) -> tuple[int, int, int]:
    """(entities predicted right, entities predicted, true entities) of one sentence's tags."""
    from seqeval.metrics.sequence_labeling import get_entities

    truth, guess = set(get_entities(list(true))), set(get_entities(list(predicted)))
    return len(truth & guess), len(guess), len(truth)
