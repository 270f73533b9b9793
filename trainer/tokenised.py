"""A task's tokenised splits: what tokenising yields (``Encoded``, one split; ``Prepared``, both and their
labels), read by batching, the loop and evaluation. A split read from the token cache holds ``Mapped`` columns
(mapped.py), one built in memory plain lists; both read alike."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpsearch.trainer.labels import LabelMap
from hpsearch.trainer.mapped import Mapped
from hpsearch.trainer.task_names import CLASSIFICATION, IGNORE_INDEX, PER_EXAMPLE, TOKEN_CLASSIFICATION


@dataclass
class Encoded:
    """A tokenised split: variable-length id lists (no padding is stored) and what they are trained to predict:
    a class id each (classification), a row of ``scores`` (regression: the number; multi-label: 0/1 per label), a
    tag id per token in ``token_labels`` (token-classification: a word's first sub-token; IGNORE_INDEX elsewhere),
    or their own next tokens after ``prompt_lengths[i]`` prompt tokens (causal-lm), or, for chat data, the tokens
    whose ``token_labels`` are not IGNORE_INDEX (the assistant's turns)."""

    input_ids: Sequence[list[int]]
    labels: Sequence[int] = field(default_factory=list)
    prompt_lengths: Sequence[int] = field(default_factory=list)
    token_labels: Sequence[list[int]] = field(default_factory=list)
    """Chat data: each token's label, its own id or IGNORE_INDEX; empty otherwise (then prompt_lengths apply)."""
    task: str = CLASSIFICATION
    dropped: list[int] = field(default_factory=list)
    """Causal-lm: the line numbers of rows left out, every token they train on lying beyond model.max_length."""
    scores: Sequence[list[float]] = field(default_factory=list)
    """Regression ([the number]) and multi-label (1.0 where a label applies, else 0.0, in label id order)."""
    token_type_ids: Sequence[list[int]] = field(default_factory=list)
    """Sentence pairs, for a tokenizer that marks the second sentence (BERT's segment ids); empty otherwise."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, indices: Sequence[int]) -> Encoded:
        """These rows only, in this order (the lists a task does not use stay empty)."""

        def pick(rows: Sequence[Any]) -> list[Any]:
            return [rows[i] for i in indices] if rows else []

        return Encoded(
            pick(self.input_ids),
            pick(self.labels),
            pick(self.prompt_lengths),
            pick(self.token_labels),
            self.task,
            scores=pick(self.scores),
            token_type_ids=pick(self.token_type_ids),
        )

    @functools.cached_property
    def lengths(self) -> Sequence[int]:
        # Cached: the loop asks for it every epoch and it is O(dataset) to rebuild. One int a row is all a worker
        # holds of a mapped split (4 bytes each, from the Arrow offsets): the ids stay in the file.
        if isinstance(self.input_ids, Mapped):
            return self.input_ids.row_lengths()
        return [len(ids) for ids in self.input_ids]

    @functools.cached_property
    def longest(self) -> int:
        """The longest row's tokens (0 for no rows)."""
        return max(self.lengths, default=0)

    def real_tokens(self, indices: Sequence[int]) -> int:
        """Tokens that carry text (special tokens included), padding excluded."""
        return sum(self.lengths[i] for i in indices)

    def padded_tokens(self, indices: Sequence[int]) -> int:
        """Tokens the model processes for this batch once padded to its longest sequence."""
        return len(indices) * max(self.lengths[i] for i in indices)

    def targets(self, indices: Sequence[int]) -> int:
        """What the loss is averaged over: examples, tagged words (token-classification), or predicted tokens for
        causal-lm (a sequence's first token and its prompt are never predicted)."""
        if self.task in PER_EXAMPLE:
            return len(indices)
        if self.token_labels:
            return sum(self._label_counts[i] for i in indices)
        lengths, prompts = self.lengths, self.prompt_lengths
        return sum(lengths[i] - max(prompts[i], 1) for i in indices)

    @functools.cached_property
    def _label_counts(self) -> Sequence[int]:
        # Causal-lm from position 1: the first token is never predicted, whatever its label. A tagger predicts
        # at every position: its [CLS] is IGNORE_INDEX anyway.
        start = 0 if self.task == TOKEN_CLASSIFICATION else 1
        if isinstance(self.token_labels, Mapped):
            return self.token_labels.counts_not(IGNORE_INDEX, start)
        return [sum(label != IGNORE_INDEX for label in labels[start:]) for labels in self.token_labels]


@dataclass
class Prepared:
    train: Encoded
    validation: Encoded
    labels: LabelMap | None
    pad_id: int
    task: str = CLASSIFICATION
    mode: int | None = None
    """The permissions for files that hold what the data says (the token cache, a best model's label names): no
    wider than the data files' own (:func:`data_mode`); None: the umask's."""
