"""Packed passes (trainer/packing.py): a packed row computes what it computes alone, so a packed step has the
loss and the gradients of the same rows padded."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification

from hpsearch.trainer import attention, packing, tasks
from hpsearch.trainer.batching import collate
from hpsearch.trainer.task_names import CLASSIFICATION, IGNORE_INDEX, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION
from hpsearch.trainer.tokenised import Encoded

CPU = torch.device("cpu")
PAD = 0


def _config(**extra: object) -> BertConfig:
    return BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,  # dropout would draw other masks for other shapes
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
        **extra,
    )


def _split(task: str, rows: int = 24, seed: int = 0, pairs: bool = False) -> Encoded:
    rng = random.Random(seed)
    lengths = [rng.randint(3, 30) for _ in range(rows)]
    ids = [[2] + [rng.randint(5, 63) for _ in range(n - 2)] + [3] for n in lengths]
    split = Encoded(ids, task=task)
    if pairs:
        split.token_type_ids = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    if task == CLASSIFICATION:
        split.labels = [rng.randint(0, 2) for _ in lengths]
    elif task == REGRESSION:
        split.scores = [[rng.uniform(0, 5)] for _ in lengths]
    elif task == MULTI_LABEL:
        split.scores = [[float(rng.random() < 0.4) for _ in range(3)] for _ in lengths]
    else:
        split.token_labels = [
            [IGNORE_INDEX] + [rng.randint(0, 2) for _ in range(n - 2)] + [IGNORE_INDEX] for n in lengths
        ]
    return split


def _model(task: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if task == TOKEN_CLASSIFICATION:
        return BertForTokenClassification(_config(num_labels=3))
    labels = {CLASSIFICATION: 3, REGRESSION: 1, MULTI_LABEL: 3}[task]
    return BertForSequenceClassification(_config(num_labels=labels))


def _step(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], task: str, packed: bool) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for batch in batches:
        logits = packing.logits(model, batch, task) if packed else tasks.logits(model, batch, task)
        loss = tasks.loss_sum(logits, batch["labels"], task)
        loss.backward()
        total += loss.detach()
    return total


@pytest.mark.parametrize(
    ("task", "pairs", "fast"),
    [
        (CLASSIFICATION, False, False),
        (CLASSIFICATION, True, True),
        (REGRESSION, True, False),
        (MULTI_LABEL, False, True),
        (TOKEN_CLASSIFICATION, False, False),
    ],
)
def test_a_packed_step_has_the_loss_and_gradients_of_its_rows_padded(task: str, pairs: bool, fast: bool) -> None:
    split = _split(task, pairs=pairs)
    model = _model(task).train()
    if fast:  # hpsearch's attention on a CPU (its mask under its own name), here in fp32
        attention.use_fast_attention(model, CPU, "bf16")
    rows = list(range(len(split)))
    padded_loss = _step(model, [collate(split, rows[:12], PAD), collate(split, rows[12:], PAD)], task, packed=False)
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    packed_bins = packing.bins(split.lengths, rows, 32)
    assert len(packing.passes(packed_bins, 4)) > 1  # several passes of several rows each, accumulated
    batches = [packing.collate(split, group, PAD) for group in packing.passes(packed_bins, 4)]
    packed_loss = _step(model, batches, task, packed=True)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == padded.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, padded[name], rtol=1e-4, atol=1e-5, msg=name)


def test_bins_hold_every_row_once_within_the_width_and_pad_little() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(5, 64) for _ in range(500)]
    for start in range(0, 500, 32):
        rows = list(range(start, min(start + 32, 500)))
        packed = packing.bins(lengths, rows, 64)
        assert sorted(i for b in packed for i in b) == rows
        fills = [sum(lengths[i] for i in b) for b in packed]
        assert max(fills) <= 64
        # No more sequences than first-fit decreasing at the full width needs (rows over half of it pack alone).
        longest_first = sorted(rows, key=lambda i: -lengths[i])
        assert len(packed) <= len(packing._first_fit(longest_first, lengths, 64, len(rows)) or [])
        assert packing.bins(lengths, rows, 64) == packed  # the same rows pack the same way
    slots = real = 0
    for start in range(0, 500, 32):
        packed = packing.bins(lengths, list(range(start, min(start + 32, 500))), 64)
        real += sum(lengths[i] for b in packed for i in b)
        slots += len(packed) * max(sum(lengths[i] for i in b) for b in packed)
    assert slots / real < 1.1


def test_only_bert_heads_on_a_cpu_are_packed() -> None:
    seq, tags = _model(CLASSIFICATION), _model(TOKEN_CLASSIFICATION)
    assert packing.packs(seq, CLASSIFICATION, CPU) and packing.packs(seq, REGRESSION, CPU)
    assert packing.packs(tags, TOKEN_CLASSIFICATION, CPU)
    assert not packing.packs(seq, CLASSIFICATION, torch.device("cuda"))
    assert not packing.packs(seq, TOKEN_CLASSIFICATION, CPU)
    assert not packing.packs(torch.nn.Linear(2, 2), CLASSIFICATION, CPU)  # a wrapper (DDP, compile, peft) is not


@pytest.mark.parametrize("task", [CLASSIFICATION, REGRESSION, MULTI_LABEL])
def test_validation_of_packed_rows_gives_the_padded_figures(task: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpsearch.trainer.evaluate import evaluate

    split = _split(task, rows=40, seed=3)
    model = _model(task)
    labels = 3 if task != REGRESSION else 0

    def figures() -> dict[str, float]:
        return evaluate(
            model, split, pad_id=PAD, batch_size=16, device=CPU, precision="fp32", num_labels=labels
        ).values()

    packed = figures()
    monkeypatch.setattr(packing, "packs", lambda *_: False)
    padded = figures()
    assert packed.keys() == padded.keys() and len(packed) > 1
    for name, value in packed.items():
        assert value == pytest.approx(padded[name], abs=1e-6), name


@pytest.mark.parametrize("task", [CLASSIFICATION, TOKEN_CLASSIFICATION])
def test_a_lora_models_packed_step_has_the_gradients_of_its_rows_padded(task: str) -> None:
    """peft puts LoRA's layers and the head's trained copy inside the model: the packed path, which calls the
    model's own modules, trains the adapter as its forward does."""
    from hpsearch.trainer.adapters import attach
    from hpsearch.trainer.config import AdapterConfig

    split = _split(task, seed=5)
    model = attach(_model(task), AdapterConfig(method="lora", r=4, alpha=8, dropout=0.0), task, 0).train()
    assert packing.packs(model, task, CPU)
    rows = list(range(len(split)))
    padded_loss = _step(model, [collate(split, rows[:12], PAD), collate(split, rows[12:], PAD)], task, packed=False)
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    batches = [packing.collate(split, g, PAD) for g in packing.passes(packing.bins(split.lengths, rows, 32), 4)]
    packed_loss = _step(model, batches, task, packed=True)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == padded.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, padded[name], rtol=1e-4, atol=1e-5, msg=name)
