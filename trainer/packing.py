"""Packed passes: a step's short rows laid end to end in a few sequences, each row attending only to itself.

A step of 32 short rows padded in two micro-batches pays twice for what a pass costs whatever its size (the 16-bit
weight casts, the embedding table's dense gradient, the weight gradients' casts back), and its small matrices run
slowly on a CPU. Packed, the step is one pass of a dozen full sequences, with as little padding as length grouping
gives. Each row keeps its own positions (0, 1, ...) and a block-diagonal mask keeps it from seeing its neighbours,
so a packed row computes what it computes alone (tests/test_packing.py: the same loss and gradients).

Validation packs the same way (not a tagger's, whose entities are read a row at a time).

Only where the head is known to be read from a row's first token (BERT's sequence and token classifiers), with or
without a LoRA adapter (whose layers live inside the model), and the model is not otherwise wrapped (one rank, not
compiled): a wrapper's own forward would be skipped. Measured on a
CPU only (benchmarks/history.md, "Packed passes"), so only there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hpsearch.trainer.sharding import is_sharded
from hpsearch.trainer.task_names import CLASSIFICATION, IGNORE_INDEX, PER_EXAMPLE, TOKEN_CLASSIFICATION
from hpsearch.trainer.tokenised import Encoded

Bin = list[int]
"""The rows of one packed sequence, in the order they are laid."""


def packs(model: torch.nn.Module, task: str, device: torch.device) -> bool:
    """Whether this model's passes are packed (see the module's note)."""
    from transformers import BertForSequenceClassification, BertForTokenClassification

    if device.type != "cpu" or is_sharded(model):  # fsdp shards the wrapper in place: its class stays a Peft one
        return False
    inner = type(_inner(model))
    if task == TOKEN_CLASSIFICATION:
        return inner is BertForTokenClassification
    return (task == CLASSIFICATION or task in PER_EXAMPLE) and inner is BertForSequenceClassification


def _inner(model: Any) -> Any:
    """The transformers model a LoRA adapter wraps: peft puts its layers (and the head's trained copy) inside it,
    and its forward is that model's own, so its modules are what the adapter model computes."""
    from hpsearch.trainer.adapters import is_adapter

    if is_adapter(model) and not model.peft_config[model.active_adapter].is_prompt_learning:
        return model.base_model.model
    return model


def bins(lengths: Sequence[int], rows: Sequence[int], width: int) -> list[Bin]:
    """``rows`` in as few sequences of at most ``width`` tokens as first-fit decreasing finds, each about as long
    as the others: the fewest sequences, then the narrowest width at which they hold every row (a pass pads each
    sequence to its longest)."""
    order = sorted(rows, key=lambda i: -lengths[i])  # stable: ties keep the step's order
    total, longest = sum(lengths[i] for i in rows), lengths[order[0]]
    count = math.ceil(total / width)
    while True:
        fit = max(longest, math.ceil(total / count))
        while fit <= width:
            packed = _first_fit(order, lengths, fit, count)
            if packed is not None:
                return packed
            fit += max(1, fit // 32)
        count += 1


def _first_fit(order: Sequence[int], lengths: Sequence[int], width: int, count: int) -> list[Bin] | None:
    packed: list[Bin] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        k = next((k for k, free in enumerate(room) if free >= n), -1)
        if k < 0:
            if len(packed) == count:
                return None
            packed.append([])
            room.append(width)
        packed[k].append(i)
        room[k] -= n
    return packed


def passes(packed: list[Bin], per_pass: int) -> list[list[Bin]]:
    """The sequences in passes of at most ``per_pass`` (the micro-batch: a pass holds no more tokens than a padded
    micro-batch of as many rows at the longest length)."""
    return [packed[i : i + per_pass] for i in range(0, len(packed), per_pass)]


def collate(data: Encoded, packed: list[Bin], pad_id: int) -> dict[str, Any]:
    """One pass's tensors: ``input_ids``, ``position_ids``, ``token_type_ids`` and the 4-D boolean
    ``attention_mask`` (True: may attend) of the packed sequences; ``labels`` in the order the rows are laid (per
    token for a tagger); ``first``, each row's first token in the flattened pass (sequence heads read it)."""
    lengths = data.lengths
    width = max(sum(lengths[i] for i in b) for b in packed)
    ids: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []
    types: list[list[int]] = []
    tags: list[list[int]] = []
    first: list[int] = []
    rows: list[int] = []
    for s, members in enumerate(packed):
        seq: list[int] = []
        pos: list[int] = []
        seg: list[int] = []
        for k, i in enumerate(members):
            first.append(s * width + len(seq))
            rows.append(i)
            seq += data.input_ids[i]
            pos += range(lengths[i])
            seg += [k] * lengths[i]
        pad = width - len(seq)
        ids.append(seq + [pad_id] * pad)
        positions.append(pos + [0] * pad)
        segments.append(seg + [len(members)] * pad)  # the padding is a segment of its own: no row sees it
        if data.token_type_ids:
            types.append([t for i in members for t in data.token_type_ids[i]] + [0] * pad)
        if data.task == TOKEN_CLASSIFICATION:
            tags.append([t for i in members for t in data.token_labels[i]] + [IGNORE_INDEX] * pad)
    seg_t = torch.tensor(segments)
    batch: dict[str, Any] = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "attention_mask": (seg_t[:, :, None] == seg_t[:, None, :])[:, None],
        "first": torch.tensor(first, dtype=torch.long),
        "rows": rows,
    }
    if types:
        batch["token_type_ids"] = torch.tensor(types, dtype=torch.long)
    if data.task == TOKEN_CLASSIFICATION:
        batch["labels"] = torch.tensor(tags, dtype=torch.long)
    elif data.task == CLASSIFICATION:
        batch["labels"] = torch.tensor([data.labels[i] for i in rows], dtype=torch.long)
    else:  # regression, multi-label
        batch["labels"] = torch.tensor([data.scores[i] for i in rows], dtype=torch.float32)
    return batch


def logits(model: Any, batch: dict[str, Any], task: str) -> torch.Tensor:
    """What the model's own forward computes for each packed row: BERT's encoder over the packed sequences, then
    its head, on every token (a tagger) or on each row's first token through the pooler (a sequence head)."""
    model = _inner(model)
    extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}
    hidden = model.bert(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        **extra,
    ).last_hidden_state
    if task == TOKEN_CLASSIFICATION:
        return model.classifier(model.dropout(hidden))
    heads = hidden.flatten(0, 1)[batch["first"]]
    return model.classifier(model.dropout(model.bert.pooler(heads[:, None])))
