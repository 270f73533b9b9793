"""One optimizer step and one validation pass, each re-planned when the device runs out of memory."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from hpsearch.trainer import packing, precision as prec, tasks
from hpsearch.trainer.batching import Batch, Batches, collate
from hpsearch.trainer.distributed import World
from hpsearch.trainer.errors import RankOutOfMemory
from hpsearch.trainer.evaluate import Metrics, evaluate
from hpsearch.trainer.sharding import is_sharded
from hpsearch.trainer.state import Trainable
from hpsearch.trainer.stats import Throughput
from hpsearch.trainer.task_names import TOKEN_CLASSIFICATION
from hpsearch.trainer.tokenised import Prepared

log = logging.getLogger(__name__)
COMPILE_BACKEND_ENV = "HPSEARCH_COMPILE_BACKEND"


def train_step(
    model: torch.nn.Module,
    parts: Trainable,
    batches: Batches,
    step: int,
    precision: str,
    device: torch.device,
    speed: Throughput,
) -> torch.Tensor | None:
    """Forward, backward and the optimizer step of ``step``; its loss on the device (summed over
    targets, normalised by the step's), or None when even micro-batch 1 runs out of memory. Out of
    memory, the step is redone with the micro-batch halved; on several ranks RankOutOfMemory is raised
    instead: the others wait in a collective, and the group restarts smaller (docs/failures.md)."""
    world, data, optimizer = batches.world, batches.data, parts.optimizer
    while True:
        group = batches.of_step(step)
        # Normalise by the targets (examples, or predicted tokens) of the whole optimizer step
        # on every rank, not per micro-batch: the summed gradient then equals one big batch's,
        # even when the last micro-batch is short. x world.size because DDP averages over ranks.
        scale = world.size / data.train.targets([i for b in group for i in b])
        mine = group[world.rank :: world.size]
        try:
            loss, done = _accumulate(model, data, mine, scale, device, precision, parts.scaler, batches.micro, world)
            break
        except torch.OutOfMemoryError as exc:
            if world.size > 1:
                raise RankOutOfMemory(batches.micro, step, world.rank) from exc
            optimizer.zero_grad(set_to_none=True)
            _release_memory(device)
            if batches.micro == 1:
                log.error("out of memory at micro-batch 1, step %d: failing the trial", step)
                return None
            batches.halve()
            log.warning(
                "out of memory at step %d: micro-batch %d, accumulation %d", step, batches.micro, batches.per_step
            )
    for counts in done:
        speed.add(examples=counts.examples, tokens=counts.tokens, padded=counts.padded)
    if batches.cfg.max_grad_norm > 0:
        parts.scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        # Returns the norm as a device tensor: no host sync.
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), batches.cfg.max_grad_norm)
    prec.optimizer_step(optimizer, parts.scheduler, parts.scaler)
    optimizer.zero_grad(set_to_none=True)
    return loss


def _accumulate(
    model: torch.nn.Module,
    data: Prepared,
    mine: list[Batch],
    scale: float,
    device: torch.device,
    precision: str,
    scaler: Any,
    micro: int,
    world: World,
) -> tuple[torch.Tensor, list[Pass]]:
    """Forward and backward of this rank's rows of one step; their summed, scaled loss on the device, and the
    passes it took."""
    step_loss = torch.zeros((), device=device)
    done: list[Pass] = []
    todo = _passes(model, data, mine, micro, device)
    with _casts_kept(precision, device, model, len(todo)):
        for i, (batch, counts) in enumerate(todo):
            # While a step still accumulates, DDP's all-reduce of every backward would be wasted.
            with world.no_sync(model, is_accumulating=i < len(todo) - 1):
                with prec.autocast(precision, device):
                    logits = (
                        packing.logits(model, batch, data.task)
                        if counts.packed
                        else tasks.logits(model, batch, data.task)
                    )
                with prec.no_autocast(device):  # autocast is for forward passes: loss and backward as they were
                    loss = tasks.loss_sum(logits, batch["labels"], data.task) * scale
                    scaler.scale(loss).backward()
            step_loss += loss.detach()
            done.append(counts)
    return step_loss, done


@dataclass(frozen=True)
class Pass:
    """What one forward and backward pass held: rows, the tokens they carry, the token slots it computed."""

    examples: int
    tokens: int
    padded: int
    packed: bool


def _passes(
    model: torch.nn.Module, data: Prepared, mine: list[Batch], micro: int, device: torch.device
) -> list[tuple[dict[str, Any], Pass]]:
    """This rank's passes of a step: its rows packed (packing.py) where the model allows, else its micro-batches
    padded."""
    train = data.train
    if packing.packs(model, data.task, device):
        packed = packing.bins(train.lengths, [i for b in mine for i in b], train.longest)
        out = []
        for group in packing.passes(packed, micro):
            batch = packing.collate(train, group, data.pad_id)
            rows = batch["rows"]
            shape = batch["input_ids"].shape
            out.append((batch, Pass(len(rows), train.real_tokens(rows), shape[0] * shape[1], packed=True)))
        return out
    return [
        (
            _to_device(collate(train, ids, data.pad_id), device),
            Pass(len(ids), train.real_tokens(ids), train.padded_tokens(ids), packed=False),
        )
        for ids in mine
    ]


def _casts_kept(
    precision: str, device: torch.device, model: torch.nn.Module, passes: int
) -> contextlib.AbstractContextManager[Any]:
    """An autocast region around a whole step of several passes, so that each trained weight is cast to 16 bits
    once a step, not once a pass: autocast caches the casts of trainable weights until its outermost region
    ends, and the passes' own (nested) regions end inside this one. The gradients are the same to the bit (tests/
    test_trainer_loop.py); a MiniLM step of two passes on a CPU spends 3.5% less (benchmarks/history.md, "A step's
    fixed costs"). Not for a sharded model: the cache would hold every gathered block's copy through the step."""
    if passes < 2 or precision == "fp32" or is_sharded(model):
        return contextlib.nullcontext()
    return prec.autocast(precision, device)


def validate(
    model: torch.nn.Module, data: Prepared, batch_size: int, device: torch.device, precision: str, world: World
) -> Metrics | None:
    """Validation, halving its batch until it fits in memory; None if even one example does not."""
    num_labels = data.labels.num_labels if data.labels else 0
    tags = data.labels.names if data.labels and data.task == TOKEN_CLASSIFICATION else ()
    while True:
        try:
            return evaluate(
                model,
                data.validation,
                pad_id=data.pad_id,
                batch_size=batch_size,
                device=device,
                precision=precision,
                num_labels=num_labels,
                tags=tags,
                world=world,
            )
        except torch.OutOfMemoryError as exc:
            if world.size > 1:  # the ranks' shards are cut by the batch size: they must all use the same
                raise RankOutOfMemory(max(batch_size // 2, 1), -1, world.rank) from exc
            _release_memory(device)
            if batch_size == 1:
                return None
            batch_size //= 2
            log.warning("out of memory in validation: batch %d", batch_size)


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile with dynamic shapes, since every batch has its own width (docs/speed.md).
    ``HPSEARCH_COMPILE_BACKEND`` picks another backend ("eager" tests the wiring without a C++ build)."""
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    return torch.compile(model, dynamic=True, backend=backend)  # type: ignore[return-value]


def flops_per_token(model: torch.nn.Module) -> float:
    """Training FLOPs per real token, 6 x parameters (forward 2, backward 4; Kaplan et al.). A frozen parameter
    (an adapter's base) costs 4: forward 2, backward 2 for its input's gradient (none for its own). Embedding
    tables are left out (a lookup multiplies nothing: counting them inflates BERT-base's figure ~28%), and so are
    attention's own matmuls. A 4-bit (QLoRA) weight counts as its matrix: bitsandbytes packs two a byte."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    counted = [p for p in model.parameters() if id(p) not in embeddings]
    trained = sum(_weights(p) for p in counted if p.requires_grad)
    frozen = sum(_weights(p) for p in counted if not p.requires_grad)
    return 6.0 * trained + 4.0 * frozen


def _weights(param: torch.Tensor) -> int:
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return int(math.prod(shape)) if shape is not None else param.numel()


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        # The failed step's activations are garbage now; hand their blocks back before retrying.
        torch.cuda.empty_cache()


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type != "cuda":
        return batch
    # Page-locked host memory lets the copy overlap with compute (non_blocking).
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
