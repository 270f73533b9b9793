"""How tokenised splits (tokenised.py) are cut into batches: shuffled by length, sharded over ranks, padded; which
micro-batches each optimizer step trains on (``Batches``)."""

from __future__ import annotations

import random
from array import array
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# MULTI_LABEL, REGRESSION and TOKEN_CLASSIFICATION: task_rows.py still takes them from here (their home is
# task_names.py).
from hpsearch.trainer.task_names import (
    CLASSIFICATION,
    IGNORE_INDEX,
    MULTI_LABEL as MULTI_LABEL,
    PER_EXAMPLE,
    REGRESSION as REGRESSION,
    TOKEN_CLASSIFICATION as TOKEN_CLASSIFICATION,
)
from hpsearch.trainer.tokenised import Encoded, Prepared

if TYPE_CHECKING:
    from hpsearch.trainer.config import TrainConfig
    from hpsearch.trainer.distributed import World

Batch = MutableSequence[int]
"""A micro-batch's row numbers: an ``array("i")`` as drawn (4 bytes a row), or a list."""


GROUP_WINDOW_STEPS = 4
"""group_by_length with one micro-batch a step: sort by length within windows of this many steps' examples. Wide
windows (50 micro-batches, transformers' choice) pad least but make each step one narrow band of lengths, and a
band's labels are not the data's (SST-2: 64% positive among the shortest quarter, 48% among the longest): at 50
micro-batches of 32, one per step, held-out accuracy fell 3 points against 4 steps (docs/decisions.md, "Length
grouping within four steps")."""

DEAL_WINDOW_MICRO_BATCHES = 64
"""group_by_length with several micro-batches a step (accumulation, or one a rank): sort within windows of this
many micro-batches (rounded to whole steps), cut them, and deal them so that each step takes one from every part
of the window's length range (``_dealt``). Narrow micro-batches pad as little as transformers' 50-batch windows,
and a step still spans the lengths (and labels) a random step does (docs/decisions.md, "Length grouping:
dealt micro-batches")."""


def micro_batches(
    lengths: Sequence[int], micro_batch_size: int, *, seed: int, epoch: int, group_by_length: bool, batch_size: int
) -> list[Batch]:
    """The epoch's micro-batches as index lists, ``batch_size // micro_batch_size`` a step in order (the last step
    may be short), deterministic in (seed, epoch). ``group_by_length`` (docs/speed.md): with one micro-batch a
    step, shuffled windows of GROUP_WINDOW_STEPS steps sorted by length inside, then the micro-batches shuffled;
    with several, ``_dealt``."""
    rng = random.Random(seed * 100_003 + epoch)
    # Row numbers as 4-byte machine ints, not a Python int object each (36 bytes a row: 36 MB at a million rows,
    # more than the memory-mapped token ids). shuffle draws the same permutation for an array as for a list.
    order = array("i", range(len(lengths)))
    rng.shuffle(order)
    per_step = max(1, batch_size // micro_batch_size)
    if group_by_length and per_step > 1:
        return _dealt(order, lengths, micro_batch_size, per_step, rng)
    if group_by_length:
        # A step is one micro-batch, so a narrow micro-batch would be a narrow step: sort only within a few
        # steps, so that each is a quarter of a random window's lengths (GROUP_WINDOW_STEPS).
        mega, grouped = batch_size * GROUP_WINDOW_STEPS, array("i")
        for start in range(0, len(order), mega):
            grouped.extend(sorted(order[start : start + mega], key=lengths.__getitem__, reverse=True))
        order = grouped
    batches = _cut(order, micro_batch_size)
    if group_by_length:
        rng.shuffle(batches)
    return batches


def _cut(order: Sequence[int], size: int) -> list[Batch]:
    return [array("i", order[i : i + size]) for i in range(0, len(order), size)]


def _dealt(order: Sequence[int], lengths: Sequence[int], micro: int, per_step: int, rng: random.Random) -> list[Batch]:
    """Steps of ``per_step`` narrow micro-batches that together span the lengths: each shuffled window of about
    DEAL_WINDOW_MICRO_BATCHES micro-batches (whole steps) is sorted by length and cut, its micro-batches split into
    ``per_step`` consecutive strata (the longest first), and each step takes one micro-batch of every stratum,
    drawn at random within it: a step is a length-stratified sample of its window, nearly as wide as a random
    step, while every pass pads only to its own narrow band. The steps are then shuffled over the epoch; what is
    short of a whole step at the epoch's end makes its last step."""
    window_steps = max(1, DEAL_WINDOW_MICRO_BATCHES // per_step)
    window = window_steps * per_step * micro
    steps: list[list[Batch]] = []
    rest: list[Batch] = []
    for start in range(0, len(order), window):
        batches = _cut(sorted(order[start : start + window], key=lengths.__getitem__, reverse=True), micro)
        # Only the epoch's last window can be short. Its partial micro-batch goes to the epoch's last step: cut
        # smaller after running out of memory (Batches.halve) it may give fewer pieces than a full one, and that
        # must shift no later step's boundary. So do its spare micro-batches, drawn from all of the window.
        if len(batches[-1]) < micro:
            rest = [batches.pop()]
        if len(batches) % per_step:
            spare = set(rng.sample(range(len(batches)), len(batches) % per_step))
            rest = [b for i, b in enumerate(batches) if i in spare] + rest
            batches = [b for i, b in enumerate(batches) if i not in spare]
        count = len(batches) // per_step
        strata = [batches[k * count : (k + 1) * count] for k in range(per_step)]
        for stratum in strata:
            rng.shuffle(stratum)
        for step in zip(*strata, strict=True):
            # Which pass (and which rank) takes the longest band varies from step to step.
            steps.append(rng.sample(step, len(step)))
    rng.shuffle(steps)
    return [b for step in steps for b in step] + rest


def even_shards(batches: list[Batch], n: int) -> list[Batch]:
    """Split the largest micro-batches in two until their count is a multiple of ``n``: every data-parallel
    rank must run as many forward/backward passes (DDP all-reduces in each one's last), the epoch's short last
    step too. The loss is normalised by the step's targets over every rank: no gradient changes."""
    batches = [b[:] for b in batches]
    while len(batches) % n:
        i = max(range(len(batches)), key=lambda j: (len(batches[j]), j))
        if len(batches[i]) < 2:
            raise ValueError(f"{sum(map(len, batches))} examples cannot feed {n} devices; use fewer devices")
        half = len(batches[i]) // 2
        batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def eval_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Validation batches sorted by length: same result, far less padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def collate(data: Encoded, indices: Sequence[int], pad_id: int) -> dict[str, Any]:
    """Pad to the longest sequence of this batch only; returns CPU tensors (pinned by caller)."""
    import torch

    lengths = data.lengths
    width = max(lengths[i] for i in indices)
    # One tensor built from padded Python lists: far cheaper than a tensor per row.
    rows = [data.input_ids[i] + [pad_id] * (width - lengths[i]) for i in indices]
    ids = torch.tensor(rows, dtype=torch.long)
    mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in indices], dtype=torch.long)
    if data.task == CLASSIFICATION:
        labels = torch.tensor([data.labels[i] for i in indices], dtype=torch.long)
    elif data.task in PER_EXAMPLE:  # regression, multi-label
        labels = torch.tensor([data.scores[i] for i in indices], dtype=torch.float32)
    elif data.token_labels:
        # Chat and tagging: only the labelled tokens count (assistant's turns, words' first sub-tokens); padding is
        # kept out of the loss.
        pad = [IGNORE_INDEX]
        labels = torch.tensor([data.token_labels[i] + pad * (width - lengths[i]) for i in indices], dtype=torch.long)
    else:
        # A causal LM predicts its own tokens; the prompt and the padding are kept out of the loss.
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        for row, i in enumerate(indices):
            labels[row, : data.prompt_lengths[i]] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if data.token_type_ids:  # a sentence pair's segments; padding is segment 0, as transformers pads it
        types = [data.token_type_ids[i] + [0] * (width - lengths[i]) for i in indices]
        batch["token_type_ids"] = torch.tensor(types, dtype=torch.long)
    return batch


def smaller_micro(micro: int) -> int | None:
    """The micro-batch after running out of memory at ``micro``: its largest divisor up to half (so every drawn
    micro-batch cuts into equal pieces), None at 1."""
    return max(d for d in range(1, micro // 2 + 1) if micro % d == 0) if micro > 1 else None


@dataclass
class Batches:
    """Which examples each optimizer step trains on: an epoch's micro-batches, drawn once per
    epoch, ``per_step`` of them a step (over every rank), shared out evenly over the ranks."""

    data: Prepared
    cfg: TrainConfig
    micro: int
    world: World
    steps_per_epoch: int
    # The micro-batch the epoch is drawn at, then cut to ``micro``: a run that restarts smaller after running out of
    # memory trains on the steps it would have trained on had it halved in place.
    drawn: int = 0
    _epoch: int = -1
    _batches: list[Batch] = field(default_factory=list)

    @property
    def per_step(self) -> int:
        return self.cfg.batch_size // self.micro

    def of_step(self, step: int) -> list[Batch]:
        """The micro-batches of optimizer step ``step``, over every rank."""
        epoch, group = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:  # the epoch's order is drawn once, not every step
            cfg, lengths, micro = self.cfg, self.data.train.lengths, self.drawn or self.micro
            drawn = micro_batches(
                lengths,
                micro,
                seed=cfg.seed,
                epoch=epoch,
                group_by_length=cfg.group_by_length,
                batch_size=cfg.batch_size,
            )
            self._batches, self._epoch = self._cut(even_shards(drawn, self.world.size)), epoch
        return self._batches[group * self.per_step : (group + 1) * self.per_step]

    def halve(self) -> None:
        """Same effective batch in smaller pieces (``smaller_micro``): each drawn micro-batch is cut in equal
        pieces, which keeps this epoch's data order and its step boundaries."""
        self.micro = smaller_micro(self.micro) or 1
        self._batches = self._cut(self._batches)

    def _cut(self, batches: list[Batch]) -> list[Batch]:
        cut = [b[i : i + self.micro] for b in batches for i in range(0, len(b), self.micro)]
        # A short micro-batch may cut into an odd count: every rank must still run as many passes.
        return even_shards(cut, self.world.size)
