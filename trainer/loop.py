"""One fine-tune: the training loop, in the spirit of nanoGPT's train.py and litgpt's fit()."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpsearch.trainer import adapters, attention, checkpoint as ckpt, precision as prec, tasks
from hpsearch.trainer.chance import Chance
from hpsearch.trainer.config import TrainConfig
from hpsearch.trainer.curves import Curves
from hpsearch.trainer.data import collate, even_shards, micro_batches
from hpsearch.trainer.dataset import Prepared
from hpsearch.trainer.distributed import World, parameter_digest
from hpsearch.trainer.evaluate import Metrics, Point, evaluate
from hpsearch.trainer.judge import Judge
from hpsearch.trainer.model import enable_gradient_checkpointing
from hpsearch.trainer.optim import build_optimizer, build_scheduler, plan_steps, warmup_steps
from hpsearch.trainer.report import RESUME_CHECKPOINT_ATTR, Reporter, StateSavingReporter, TrainResult
from hpsearch.trainer.stats import Throughput

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What one trial trains: model, tokenizer, data, config and where its files go."""

    model: torch.nn.Module
    tokenizer: Any
    data: Prepared
    cfg: TrainConfig
    metric: str  # "loss" (minimise), "accuracy" or "f1" (maximise)
    device: torch.device
    out_dir: Path
    resume_from: Path | None = None
    should_stop: Callable[[], bool] = lambda: False
    stop_waiting: Callable[[], bool] = lambda: False
    """After a stop, when a reporter call still on its way is given up (see StateSavingReporter)."""
    meta: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    """time.monotonic() when the trial began (before the model copy); default: fit's entry."""
    world: World = field(default_factory=World)
    """The trial's data-parallel ranks (one by default); only rank 0 reports and saves."""
    stop_at_chance: int = 0
    """Stop the run (as pruned, reason "at_chance") once this many validation points in a
    row, after its warm-up and its first fifth, were no better than predicting the label
    prior (see trainer/chance.py; 0 = never). Classification only; read on rank 0, which
    decides for every rank."""
    patient_pruning: bool = False
    """Ask the reporter whether to prune only about points that say something of the
    hyperparameters (see trainer/judge.py)."""


def fit(run: Run, reporter: Reporter) -> TrainResult:
    started = run.started if run.started is not None else time.monotonic()
    cfg, device, data, world = run.cfg, run.device, run.data, run.world
    # The spec checks each searched value, and pairs of them, but not every combination of a
    # wide space: a sampled batch size that does not divide into micro-batches is said here.
    cfg.validate()
    precision = prec.resolve(cfg.precision, device)
    # Ranks draw different dropout masks; their weights are equal anyway (DDP starts from rank 0's).
    torch.manual_seed(cfg.seed + world.rank)
    if not getattr(run.model, "is_quantized", False):
        # A quantized (QLoRA) base was put on its GPU by bitsandbytes as it loaded, and cannot be moved.
        run.model.to(device)
    run.model.train()
    attention.use_fast_attention(run.model, device, precision)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(run.model)
    # The optimizer and checkpoints hold the plain module; only the forward pass is compiled.
    # Validation runs `compiled` without DDP: each rank scores its own share of the batches.
    compiled = compile_model(run.model) if cfg.compile else run.model
    model = world.wrap(compiled, device)
    micro = cfg.batch_size // world.size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
    total_steps, steps_per_epoch = plan_steps(len(data.train), cfg.batch_size, cfg.epochs, cfg.max_steps)
    optimizer = build_optimizer(run.model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = prec.grad_scaler(precision, device)
    step, best, micro = _restore(run, optimizer, scheduler, scaler, reporter, micro)
    saved: tuple[int, Path] | None = None  # the step of the resumable state last written, and where

    def save_state() -> Path:
        """The resumable state of the step reached (step, best point, ... as they are now),
        written once per step: a stop and a failing call at the same step need one copy."""
        nonlocal saved
        if saved is None or saved[0] != step:
            saved = (step, _save_resume(run, optimizer, scheduler, scaler, step, best, micro))
        return saved[1]

    reporter = StateSavingReporter(reporter, save_state, run.should_stop, run.stop_waiting)
    per_step = cfg.batch_size // micro  # micro-batches of one optimizer step, over every rank
    speed = Throughput(device, flops_per_token=flops_per_token(run.model))
    curves = Curves(run.out_dir, device, enabled=world.is_main)  # TensorBoard files under the trial's folder
    first_step: float | None = None
    result = TrainResult(status="complete")
    # Loss is accumulated on the device and read with .item() only at validation points:
    # .item() forces a host-device sync that would stall the GPU's queue every step.
    running_loss = torch.zeros((), device=device)
    running_steps = 0
    judge = Judge(
        Chance.of(data.validation.labels),
        warmup_steps(cfg, total_steps),
        total_steps,
        run.metric,
        stop_at_chance=run.stop_at_chance,
        patient=run.patient_pruning,
    )

    batches: list[list[int]] = []
    batches_epoch = -1
    last_resume = time.monotonic()
    while step < total_steps:
        epoch, group_in_epoch = divmod(step, steps_per_epoch)
        if epoch != batches_epoch:  # the epoch's order is drawn once, not every step
            batches = micro_batches(
                data.train.lengths, micro, seed=cfg.seed, epoch=epoch, group_by_length=cfg.group_by_length
            )
            batches = even_shards(batches, world.size)  # every rank gets as many micro-batches
            batches_epoch = epoch
        group = batches[group_in_epoch * per_step : (group_in_epoch + 1) * per_step]
        # Normalise by the targets (examples, or predicted tokens) of the whole optimizer step
        # on every rank, not per micro-batch: the summed gradient then equals one big batch's,
        # even when the last micro-batch is short. x world.size because DDP averages over ranks.
        scale = world.size / data.train.targets([i for b in group for i in b])
        mine = group[world.rank :: world.size]
        if first_step is None:
            # How long the trial took to get going (model copy, optimizer, data, resume).
            first_step = time.monotonic() - started
        speed.resume()
        try:
            step_loss = _accumulate(model, data, mine, scale, device, precision, scaler, world)
        except torch.OutOfMemoryError:
            if world.size > 1:
                raise  # one rank cannot re-plan its step alone: its peers wait in an all-reduce
            # Same effective batch in smaller pieces: the step is redone from its first micro-batch.
            optimizer.zero_grad(set_to_none=True)
            _release_memory(device)
            if micro == 1:
                log.error("out of memory at micro-batch 1, step %d: failing the trial", step)
                result = TrainResult(status="failed", fail_reason="oom")
                break
            micro = halved(micro)
            per_step = cfg.batch_size // micro
            # Cutting each drawn micro-batch keeps this epoch's data order and step boundaries.
            batches = [b[i : i + micro] for b in batches for i in range(0, len(b), micro)]
            log.warning("out of memory at step %d: micro-batch %d, accumulation %d", step, micro, per_step)
            continue
        running_loss += step_loss
        for indices in mine:
            speed.add(
                examples=len(indices), tokens=data.train.real_tokens(indices), padded=data.train.padded_tokens(indices)
            )
        if cfg.max_grad_norm > 0:
            scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
            # Returns the norm as a device tensor: no host sync.
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
        prec.optimizer_step(optimizer, scheduler, scaler)
        optimizer.zero_grad(set_to_none=True)
        step += 1
        running_steps += 1

        stopping = world.from_main(run.should_stop())  # rank 0's stop request ends every rank here
        if step % cfg.eval_every == 0 or step == total_steps or stopping:
            # Summed over ranks, every rank sees the same loss (and the same NaN).
            train_loss = world.all_sum(running_loss).item() / world.size / running_steps
            speed.pause()
            curves.train(step, loss=train_loss, lr=scheduler.get_last_lr()[0], speed=speed)
            running_loss.zero_()
            running_steps = 0
            if not math.isfinite(train_loss):
                result = TrainResult(status="pruned", fail_reason="nan_loss")
                log.warning("train loss is %s at step %d: pruning", train_loss, step)
                break
            if stopping:
                if world.is_main:
                    save_state()
                result = TrainResult(status="interrupted")
                break
            metrics = _evaluate_fitting(compiled, data, micro * 2, device, precision, world)
            if metrics is None:
                result = TrainResult(status="failed", fail_reason="oom")
                break
            curves.validation(step, metrics)
            point = Point(metrics.objective(run.metric), metrics.loss, step)
            shown = " ".join(f"val_{k} {v:.4f}" for k, v in metrics.values().items())
            log.info("step %d/%d train_loss %.4f %s", step, total_steps, train_loss, shown)
            # Order of a validation point: evaluate, save if best, report, then ask to prune.
            if point.beats(best, run.metric):
                best = point
                if world.is_main:
                    path = ckpt.save_best(run.model, run.tokenizer, run.out_dir, _meta(run, metrics, step))
                    reporter.set_attrs({"best_checkpoint": str(path.resolve()), "best_step": step, **_best(metrics)})
            if world.is_main:
                # The resumable state (weights + optimizer moments, ~3x the model) is costly to
                # write, so it is refreshed at most every resume_every_minutes.
                if step < total_steps and time.monotonic() - last_resume >= cfg.resume_every_minutes * 60:
                    state = save_state()
                    # Recorded so that a retry on another worker can find it (see search/reap.py).
                    reporter.set_attrs({RESUME_CHECKPOINT_ATTR: str(state.resolve())})
                    last_resume = time.monotonic()
                reporter.report(point.value, step)
            judge.see(step, metrics)  # only rank 0 has the options; it decides for all
            # One broadcast for both reasons; the pruner is not asked about a run stopped at chance.
            ask = judge.may_prune(step, metrics)
            if world.from_main(world.is_main and (judge.stuck or (ask and reporter.should_prune()))):
                if judge.stuck:
                    log.info(
                        "step %d: no better than the label prior %d points in a row: stopping", step, judge.at_chance
                    )
                result = TrainResult(status="pruned", fail_reason="at_chance" if judge.stuck else None)
                break

    speed.pause()
    curves.close()
    result.steps = step
    if best is not None:
        result.best_value, result.best_step = best.value, best.step
        result.best_checkpoint = str((run.out_dir / ckpt.BEST).resolve())
    result.attrs = {
        **_ranks_attrs(world, speed, run.model),
        "precision": precision,
        "micro_batch_size": micro,
        "accumulation_steps": per_step // world.size,
        "compiled": cfg.compile,
        # An adapter trains a fraction of a percent of the model: the figure says how much.
        "trainable_parameters": adapters.trainable_parameters(run.model),
    }
    if first_step is not None:
        result.attrs["first_step_seconds"] = round(first_step, 3)
    if world.is_main:
        reporter.set_attrs(result.attrs)
        # Reports went out in the background (see courier.py); the search must have them all
        # before the worker tells it how the run ended.
        reporter.flush()
    return result


def _restore(
    run: Run, optimizer: Any, scheduler: Any, scaler: Any, reporter: Reporter, micro: int
) -> tuple[int, Point | None, int]:
    """Load a resumable checkpoint, if the run has one: (step, best point, micro-batch)."""
    if run.resume_from is None:
        return 0, None, micro
    try:
        state = ckpt.load_resume(run.resume_from)
    except Exception as exc:  # torch.load's errors: truncated zip, bad pickle, missing file
        # A checkpoint cut short (a full disk, a copy interrupted) must not cost the trial:
        # it trains again from the start.
        log.warning("cannot read the resumable state %s (%s); training from the start", run.resume_from, exc)
        return 0, None, micro
    if adapters.is_adapter(run.model):
        adapters.load_trainable(run.model, state["model"])
    else:
        run.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
    # A micro-batch that ran out of memory before the restart would do so again.
    saved_micro = state.get("micro_batch_size")
    if isinstance(saved_micro, int):
        micro = min(micro, saved_micro)
    log.info("resumed from %s at optimizer step %d", run.resume_from, state["step"])
    best, best_attrs = _restored_best(run, state["best_step"])
    if run.world.is_main:
        reporter.set_attrs({"resumed_from_step": state["step"], **best_attrs})
    return state["step"], best, micro


def _restored_best(run: Run, saved_step: int | None) -> tuple[Point | None, dict[str, Any]]:
    """The best point a resumed run starts from, and its trial attributes: the one whose model
    is in the run's folder (moved there from the interrupted attempt's), read from the model's
    own meta, not from the resumable state. The state may be older than the last best model
    (it is written at most every resume_every_minutes), and a best point whose model is gone
    would leave the trial with a value no checkpoint has: then the best starts over."""
    meta = ckpt.best_meta(run.out_dir)
    value = meta.get(f"val_{run.metric}") if meta else None
    step = meta.get("step") if meta else None
    if meta is None or not isinstance(value, int | float) or not isinstance(step, int):
        if saved_step is not None:
            log.warning("the best model of step %d is not in %s: the best point starts over", saved_step, run.out_dir)
        return None, {}
    loss = meta.get("val_loss")
    attrs = {
        "best_checkpoint": str((run.out_dir / ckpt.BEST).resolve()),
        "best_step": step,
        **{f"best_{k}": v for k, v in meta.items() if k.startswith("val_")},  # as _best() names them
    }
    return Point(float(value), float(loss) if isinstance(loss, int | float) else math.inf, step), attrs


def _ranks_attrs(world: World, speed: Throughput, model: torch.nn.Module) -> dict[str, Any]:
    """Throughput over every rank and, with several, each rank's parameter digest: equal
    digests are the evidence that data parallelism kept the ranks' parameters identical."""
    if world.size == 1:
        return speed.attrs()
    digest = parameter_digest(model)
    counts = world.gather((speed.examples, speed.tokens, speed.padded, digest))
    speed.examples, speed.tokens, speed.padded = (sum(c[k] for c in counts) for k in range(3))
    digests = [c[3] for c in counts]
    log.info("rank %d of %d: parameter digest %s", world.rank, world.size, digest)
    if len(set(digests)) > 1:
        log.error("the ranks' parameters differ (digests %s)", digests)
    return {**speed.attrs(), "devices": world.size, "rank_parameter_digests": digests}


COMPILE_BACKEND_ENV = "HPSEARCH_COMPILE_BACKEND"


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile with shapes marked dynamic up front: dynamic padding changes the sequence
    length every batch, and a static graph would be recompiled for each new width.

    ``HPSEARCH_COMPILE_BACKEND`` picks another backend than inductor ("aot_eager" to tell a
    compiler bug from a model bug, "eager" to test the wiring without a C++ build).
    """
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    return torch.compile(model, dynamic=True, backend=backend)  # type: ignore[return-value]


def flops_per_token(model: torch.nn.Module) -> float:
    """Training FLOPs per real token, 6 x parameters (forward 2, backward 4; Kaplan et al.).

    A frozen parameter (an adapter's base) costs 4: forward 2, and 2 in the backward pass for
    the gradient of its input, which the layers below need; it has no weight gradient.
    Embedding tables are left out: a lookup multiplies nothing, and counting its rows would
    inflate the figure (by ~28% for BERT-base). Attention's own matmuls are left out too.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    counted = [p for p in model.parameters() if id(p) not in embeddings]
    trained = sum(p.numel() for p in counted if p.requires_grad)
    frozen = sum(p.numel() for p in counted if not p.requires_grad)
    return 6.0 * trained + 4.0 * frozen


def _accumulate(
    model: torch.nn.Module,
    data: Prepared,
    mine: list[list[int]],
    scale: float,
    device: torch.device,
    precision: str,
    scaler: Any,
    world: World,
) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns their
    loss (summed over targets, times ``scale``)."""
    step_loss = torch.zeros((), device=device)
    for i, indices in enumerate(mine):
        batch = _to_device(collate(data.train, indices, data.pad_id), device)
        with world.no_sync(model, is_accumulating=i < len(mine) - 1):
            with prec.autocast(precision, device):
                logits = tasks.logits(model, batch, data.task)
            loss = tasks.loss_sum(logits, batch["labels"], data.task) * scale
            scaler.scale(loss).backward()
        step_loss += loss.detach()
    return step_loss


def halved(micro: int) -> int:
    """The largest divisor of ``micro`` up to half of it: the effective batch stays a whole
    number of micro-batches, and each drawn micro-batch splits into equal pieces."""
    return max(d for d in range(1, micro // 2 + 1) if micro % d == 0)


def _evaluate_fitting(
    model: torch.nn.Module, data: Prepared, batch_size: int, device: torch.device, precision: str, world: World
) -> Metrics | None:
    """Validation, halving its batch until it fits in memory; None if even one example does not."""
    num_labels = data.labels.num_labels if data.labels else 0
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
                world=world,
            )
        except torch.OutOfMemoryError:
            if world.size > 1:
                raise  # the ranks' shards are cut by the batch size: they must all use the same
            _release_memory(device)
            if batch_size == 1:
                return None
            batch_size //= 2
            log.warning("out of memory in validation: batch %d", batch_size)


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        # The failed step's activations are garbage now; hand their blocks back before retrying.
        torch.cuda.empty_cache()


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type != "cuda":
        return batch
    # Page-locked host memory lets the copy overlap with compute (non_blocking).
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def _save_resume(
    run: Run,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    step: int,
    best: Point | None,
    micro: int,
) -> Path:
    return ckpt.save_resume(
        run.out_dir,
        {
            # The plain module: no DDP / compile prefixes. Of an adapter, only what it trains.
            "model": adapters.trainable_state(run.model) if adapters.is_adapter(run.model) else run.model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "step": step,
            "best_value": best.value if best else None,
            "best_step": best.step if best else None,
            "config": vars(run.cfg),
            "micro_batch_size": micro,
        },
    )


def _meta(run: Run, metrics: Metrics, step: int) -> dict[str, Any]:
    values = {f"val_{k}": v for k, v in metrics.values().items()}
    meta = {**run.meta, "step": step, **values, "train": vars(run.cfg)}
    if run.data.labels is not None:
        # An adapter folder has no config.json to hold them: a merged export names its labels from here.
        meta["id2label"] = {str(k): v for k, v in run.data.labels.id2label().items()}
    return meta


def _best(metrics: Metrics) -> dict[str, float]:
    """best_val_loss and best_val_accuracy / best_val_f1, or best_val_perplexity for a causal LM."""
    return {f"best_val_{k}": v for k, v in metrics.values().items()}
