"""One fine-tune: the training loop, in the spirit of nanoGPT's train.py and litgpt's fit().
When a run ends early is the search's business: the reporter says whether to prune (search/workers/early_stop.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpsearch.trainer import adapters, attention, checkpoint as ckpt, held, precision as prec, sharding
from hpsearch.trainer.batching import Batches
from hpsearch.trainer.config import TrainConfig
from hpsearch.trainer.curves import Curves
from hpsearch.trainer.distributed import World, parameter_digest
from hpsearch.trainer.dropout import use_mask_dropout
from hpsearch.trainer.errors import RankOutOfMemory
from hpsearch.trainer.evaluate import Metrics, Point
from hpsearch.trainer.model import enable_gradient_checkpointing
from hpsearch.trainer.optim import build_optimizer, build_scheduler, plan_steps
from hpsearch.trainer.points import EarlyPoints, PointRows, point_at
from hpsearch.trainer.report import FailReason, Reporter, StateSavingReporter, Status, TrainResult
from hpsearch.trainer.state import Trainable, TrainState
from hpsearch.trainer.stats import Figures, Throughput
from hpsearch.trainer.step import COMPILE_BACKEND_ENV, compile_model, flops_per_token, train_step, validate
from hpsearch.trainer.tokenised import Prepared

__all__ = ["COMPILE_BACKEND_ENV", "Run", "compile_model", "fit", "flops_per_token"]
log = logging.getLogger(__name__)


@dataclass
class Run:
    """What one trial trains: model, tokenizer, data, config and where its files go."""

    model: torch.nn.Module
    tokenizer: Any
    data: Prepared
    cfg: TrainConfig
    metric: str  # "loss" (minimise), or another of the task's metrics (maximise; trainer/config.py TASK_METRICS)
    device: torch.device
    files: ckpt.RunFiles
    resume_from: Path | None = None
    should_stop: Callable[[], bool] = lambda: False
    stop_waiting: Callable[[], bool] = lambda: False  # after a stop: when a hanging reporter call is given up
    meta: dict[str, Any] = field(default_factory=dict)
    started: float | None = None  # time.monotonic() at the trial's start (before the model copy); default: fit's entry
    world: World = field(default_factory=World)  # the data-parallel ranks; only rank 0 reports and saves
    early: EarlyPoints = field(default_factory=EarlyPoints)  # the pruner's points before the first eval_every
    point_rows: PointRows = field(default_factory=PointRows)  # data.validation_rows: what a full point scores


@dataclass
class Loop:
    """What ``fit`` set up for the run: its parts, the trainable objects, and the loop's bookkeeping."""

    run: Run
    model: torch.nn.Module  # what trains: DDP-wrapped on several ranks, compiled with train.compile
    compiled: torch.nn.Module  # what validates (not DDP-wrapped: each rank scores its own share)
    parts: Trainable
    precision: str
    total_steps: int
    batches: Batches
    policy: prec.Policy
    speed: Throughput = field(init=False)
    curves: Curves = field(init=False)
    # The train loss summed on the device since the last validation point, read there only: .item() is a host sync.
    running_loss: torch.Tensor = field(init=False)
    reporter: StateSavingReporter = field(init=False)
    # The step and path of the resumable state last written: a stop and a failing call at one step need one copy.
    saved: tuple[int, Path] | None = None
    last_resume: float = field(default_factory=time.monotonic)
    running_steps: int = 0
    validating: float = 0.0  # seconds spent in validation
    early_data: Prepared = field(init=False)  # what an early point scores: run.early's subset of the validation rows
    point_data: Prepared = field(init=False)  # what a full point scores: run.point_rows' subset, or every row
    # data.validation_rows: the best point's trained weights (host memory), re-scored on every row at the end.
    best_weights: dict[str, torch.Tensor] | None = None
    final_rows: int | None = None  # the rows the trial's value was scored on, once its best was re-scored

    def __post_init__(self) -> None:
        run = self.run
        self.speed = Throughput(run.device, flops_per_token=flops_per_token(run.model))
        self.curves = Curves(run.files.curves, run.device, enabled=run.world.is_main)
        self.running_loss = torch.zeros((), device=run.device)


def fit(run: Run, reporter: Reporter) -> TrainResult:
    started = run.started if run.started is not None else time.monotonic()
    if ckpt.out_of_memory_at(run.files.out_of_memory) == 1:
        # Every rank reads the same record, before any collective: they all end here.
        log.error("a previous attempt ran out of memory at micro-batch 1: failing the trial")
        return TrainResult(Status.FAILED, fail_reason=FailReason.OOM)
    loop, state = _setup(run, reporter)
    try:
        return _train(loop, state, started)
    except RankOutOfMemory as oom:
        # The group restarts: every rank of the next attempt reads this and starts smaller (Trainable.restore).
        ckpt.record_out_of_memory(run.files.out_of_memory, oom.micro, oom.step, oom.rank)
        raise
    except Exception:
        loop.reporter.settle()  # what the run reported reaches the search before the search ends the trial
        raise


def _train(loop: Loop, state: TrainState, started: float) -> TrainResult:
    """Optimizer steps, and a validation point every ``eval_every``, until the run ends."""
    run = loop.run
    # How long the trial took to get going (model copy, optimizer, data, resume); None without a step to take.
    first_step = time.monotonic() - started if state.step < loop.total_steps else None
    result: TrainResult | None = None
    while result is None and state.step < loop.total_steps:
        loop.speed.resume()
        loss = train_step(loop.model, loop.parts, loop.batches, state.step, loop.precision, run.device, loop.speed)
        state.micro = loop.batches.micro
        if loss is None:
            result = TrainResult(Status.FAILED, fail_reason=FailReason.OOM)
            break
        loop.running_loss += loss
        loop.running_steps += 1
        state.step += 1
        stopping = run.world.from_main(run.should_stop())  # rank 0's stop request ends every rank here
        point = point_at(state.step, loop.total_steps, run.cfg.eval_every, run.early)
        if point == "full" or stopping:
            result = validation_point(loop, state, stopping)
        elif point == "early":
            result = early_point(loop, state)
    if result is None and loop.point_data is not run.data:
        result = rescore_best(loop, state)
    return _finish(loop, state, result or TrainResult(Status.COMPLETE), first_step)


def validation_point(loop: Loop, state: TrainState, stopping: bool) -> TrainResult | None:
    """Evaluate, save if best, report, then ask to prune (as in optuna-examples' checkpoint
    example); how the run ends if it ends here, else None."""
    run, world = loop.run, loop.run.world
    # Summed over ranks, every rank sees the same loss (and the same NaN).
    train_loss = world.all_sum(loop.running_loss).item() / world.size / loop.running_steps
    loop.speed.pause()
    loop.curves.train(state.step, loss=train_loss, lr=loop.parts.scheduler.get_last_lr()[0], speed=loop.speed)
    loop.running_loss.zero_()
    loop.running_steps = 0
    if not math.isfinite(train_loss):
        log.warning("train loss is %s at step %d: pruning", train_loss, state.step)
        return TrainResult(Status.PRUNED, fail_reason=FailReason.NAN_LOSS)
    if stopping:
        _save_state(loop, state)  # every rank: a sharded state is written by all of them
        return TrainResult(Status.INTERRUPTED)
    metrics = _validate(loop, loop.point_data, state.micro)
    if metrics is None:
        return TrainResult(Status.FAILED, fail_reason=FailReason.OOM)
    loop.curves.validation(state.step, metrics)
    point = Point(metrics.objective(run.metric), metrics.loss, state.step)
    shown = " ".join(f"val_{k} {v:.4f}" for k, v in metrics.values().items())
    log.info("step %d/%d train_loss %.4f %s", state.step, loop.total_steps, train_loss, shown)
    if point.beats(state.best, run.metric):  # the same answer on every rank: the metrics are summed over them
        state.best = point
        _save_best(loop, metrics, state.step)
        if loop.point_data is not run.data:  # kept to re-score on every row at the end (rescore_best)
            loop.best_weights = _trained_weights(run.model)
    # The resumable state (weights and optimizer moments, ~3x the model) is costly to write: it is
    # refreshed at most every resume_every_minutes, by rank 0's clock.
    due = time.monotonic() - loop.last_resume >= run.cfg.resume_every_minutes * 60
    if world.from_main(state.step < loop.total_steps and due):
        path = _save_state(loop, state)
        loop.last_resume = time.monotonic()
        if world.is_main:
            # Recorded so that a retry on another worker can find it (see search/workers/reap.py).
            loop.reporter.state_saved(path.resolve())
    return _judge(loop, point.value, state.step, metrics)


def early_point(loop: Loop, state: TrainState) -> TrainResult | None:
    """A point the pruner asked for: the early subset scored, reported and judged, nothing saved (a trial's value
    and its checkpoint come from full points); the train loss keeps running to the next full point."""
    run = loop.run
    loop.speed.pause()
    metrics = _validate(loop, loop.early_data, state.micro)
    if metrics is None:
        return TrainResult(Status.FAILED, fail_reason=FailReason.OOM)
    value = metrics.objective(run.metric)
    rows = len(loop.early_data.validation)
    # The loss too: an early point cuts a trial on it (flat at the label prior's: search/workers/early_stop.py).
    shown = f"val_loss {metrics.loss:.4f}" + (f" val_{run.metric} {value:.4f}" if run.metric != "loss" else "")
    log.info("step %d/%d early point (%d rows) %s", state.step, loop.total_steps, rows, shown)
    return _judge(loop, value, state.step, metrics)


def rescore_best(loop: Loop, state: TrainState) -> TrainResult | None:
    """data.validation_rows, at a trial's end: its best point's weights scored on every validation row, which
    becomes its value (and its best_val_* attributes); its points stay the subset's. How the run ends if it ends
    here, else None."""
    run, best = loop.run, state.best
    if best is None:
        return None
    if loop.best_weights is not None:
        _load_trained(run.model, loop.best_weights)
        loop.best_weights = None
    elif best.step != state.step:
        # Resumed after its best point: those weights are in the checkpoint only, not in this process.
        log.warning(
            "the best point (step %d) came before this attempt resumed: the trial's value stays its score on "
            "the %d validation_rows",
            best.step,
            len(loop.point_data.validation),
        )
        return None
    metrics = _validate(loop, run.data, state.micro)
    if metrics is None:
        return TrainResult(Status.FAILED, fail_reason=FailReason.OOM)
    value, rows = metrics.objective(run.metric), len(run.data.validation)
    log.info(
        "best point (step %d) re-scored on all %d validation rows: %s %.4f (%.4f on the %d validation_rows)",
        best.step,
        rows,
        run.metric,
        value,
        best.value,
        len(loop.point_data.validation),
    )
    state.best, loop.final_rows = best._replace(value=value, loss=metrics.loss), rows
    if run.world.is_main:
        loop.reporter.best_saved(run.files.best.resolve(), best.step, metrics.values())
    return None


def _trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy, in host memory, of what training changes (every parameter of a full fine-tune; an adapter's and
    its head's): the frozen rest is as it was."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def _load_trained(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name])


def _judge(loop: Loop, value: float, step: int, metrics: Metrics) -> TrainResult | None:
    """Report a point and ask whether to prune: only rank 0 talks to the search, and its answer is every rank's."""
    world = loop.run.world
    if world.is_main:
        loop.reporter.report(value, step, metrics)
    return TrainResult(Status.PRUNED) if world.from_main(world.is_main and loop.reporter.should_prune()) else None


def _validate(loop: Loop, data: Prepared, micro: int) -> Metrics | None:
    """Score ``data``'s validation rows, timed (the benchmarks weigh what validating costs against what it saves)."""
    started = time.perf_counter()
    metrics = validate(loop.compiled, data, micro * 2, loop.run.device, loop.precision, loop.run.world)
    loop.validating += time.perf_counter() - started
    return metrics


def _setup(run: Run, reporter: Reporter) -> tuple[Loop, TrainState]:
    cfg, device, world = run.cfg, run.device, run.world
    # The spec checks each searched value, and pairs of them, but not every combination of a
    # wide space: a sampled batch size that does not divide into micro-batches is said here.
    cfg.validate()
    policy = _policy(run)
    precision = policy.compute
    # Ranks draw different dropout masks; their weights are equal anyway (DDP starts from rank 0's).
    torch.manual_seed(cfg.seed + world.rank)
    # Sharded wherever there is a process group to shard over (one rank of one: the GPU check's path).
    sharded = cfg.sharding == "fsdp" and torch.distributed.is_available() and torch.distributed.is_initialized()
    # The policy's dtypes before anything is made of the weights (device copy, shards, optimizer moments).
    prec.apply(run.model, policy)
    if not getattr(run.model, "is_quantized", False) and not sharded:
        # A quantized (QLoRA) base was put on its GPU by bitsandbytes as it loaded, and cannot be moved. A sharded
        # model reaches its device as it is sharded, block by block: never whole.
        run.model.to(device)
    run.model.train()
    attention.use_fast_attention(run.model, device, precision)
    use_mask_dropout(run.model, device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(run.model)
    if sharded:
        # In place, before the optimizer is made: its moments are then shard-sized too.
        blocks = sharding.shard_from_first(run.model, precision, device, world)
        log.info("sharded over %d ranks: %d blocks and the root", world.size, blocks)
    # The optimizer and checkpoints hold the plain module; only the forward pass is compiled.
    compiled = compile_model(run.model) if cfg.compile else run.model
    micro = cfg.batch_size // world.size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
    total_steps, steps_per_epoch = plan_steps(len(run.data.train), cfg.batch_size, cfg.epochs, cfg.max_steps)
    optimizer = build_optimizer(run.model, cfg, device, compensated=policy.compensated)
    scaler = sharding.grad_scaler(precision, device) if sharded else prec.grad_scaler(precision, device)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    parts = Trainable(run.model, optimizer, scheduler, scaler, run.files, vars(cfg), world)
    state = parts.restore(run.resume_from, run.metric, micro, total_steps)
    if state.resumed_from is not None and world.is_main:
        reporter.resumed(state.resumed_from)
        if state.best is not None and state.best_values is not None:
            reporter.best_saved(run.files.best.resolve(), state.best.step, state.best_values)
    batches = Batches(run.data, cfg, state.micro, world, steps_per_epoch, drawn=micro)
    loop = Loop(run, world.wrap(compiled, device), compiled, parts, precision, total_steps, batches, policy)
    loop.early_data = dataclasses.replace(run.data, validation=run.early.data(run.data.validation))
    loop.point_data = _point_data(run, sharded=loop.parts.sharded)
    loop.reporter = StateSavingReporter(
        reporter, lambda: _state_for_reporter(loop, state), run.should_stop, run.stop_waiting
    )
    return loop, state


def _point_data(run: Run, *, sharded: bool) -> Prepared:
    """What a full point scores: data.validation_rows' subset, or every row (and why, said once)."""
    rows, validation = run.point_rows.rows, run.data.validation
    if not rows:
        return run.data
    if not run.point_rows.active(validation):
        log.info(
            "data.validation_rows %d: the validation split has %d rows; every point scores all", rows, len(validation)
        )
        return run.data
    if sharded:
        # A sharded model's best is not copied out of its shards to be re-scored: points score every row.
        log.warning(
            "data.validation_rows is not used by a sharded trial: every point scores all %d rows", len(validation)
        )
        return run.data
    log.info(
        "validation points score %d of the %d validation rows (data.validation_rows); the best, all",
        rows,
        len(validation),
    )
    return dataclasses.replace(run.data, validation=run.point_rows.data(validation))


def _policy(run: Run) -> prec.Policy:
    """The trial's precision policy: its compute on this device, the dtype its checkpoint is stored in (as the
    loader read it; a model built here, the dtype it was built in), adapter or not."""
    compute = prec.resolve(run.cfg.precision, run.device)
    stored = getattr(run.model, "hpsearch_stored", None)
    if not isinstance(stored, torch.dtype):
        stored = next((p.dtype for p in run.model.parameters() if p.is_floating_point()), torch.float32)
    chosen = prec.policy(run.cfg.precision, compute, stored, adapter=adapters.is_adapter(run.model))
    log.info(
        "precision %s: trained weights, gradients and optimizer state %s, compute %s, best model saved as %s",
        chosen.regime,
        str(chosen.trained).removeprefix("torch."),
        chosen.compute,
        str(chosen.stored).removeprefix("torch."),
    )
    return chosen


def _save_state(loop: Loop, state: TrainState) -> Path:
    """The resumable state of the step reached, written once per step (every rank calls it)."""
    if loop.saved is None or loop.saved[0] != state.step:
        loop.saved = (state.step, loop.parts.save(state))
    return loop.saved[1]


def _state_for_reporter(loop: Loop, state: TrainState) -> Path:
    """What rank 0's reporter saves when the search cannot be reached. A sharded state needs every rank, and the
    others are not there to help: the retry resumes from the last one written (every resume_every_minutes)."""
    if loop.parts.sharded:
        log.warning("the search is unreachable: a sharded trial resumes from its last resumable state")
        return loop.saved[1] if loop.saved else loop.run.files.state
    return _save_state(loop, state)


def _save_best(loop: Loop, metrics: Metrics, step: int) -> None:
    """Save the best model (rank 0), from weights gathered off every rank when they are sharded."""
    run = loop.run
    weights = None
    if loop.parts.sharded:
        # A collective: every rank sends its shards; they reach rank 0's host memory one block at a time.
        weights = sharding.full_state(run.model, trained_only=adapters.is_adapter(run.model))
    if run.world.is_main:
        meta, mode = _meta(run, metrics, step), run.data.mode  # the label names in config.json are the data's
        path = ckpt.save_best(run.model, run.tokenizer, run.files.best, meta, weights, loop.policy.stored, mode)
        loop.reporter.best_saved(path.resolve(), step, metrics.values())


def _finish(loop: Loop, state: TrainState, result: TrainResult, first_step: float | None) -> TrainResult:
    run, world = loop.run, loop.run.world
    loop.speed.pause()
    loop.curves.close()
    result.steps = state.step
    if state.best is not None:
        result.best_value, result.best_step = state.best.value, state.best.step
    digests = _rank_digests(world, loop.speed, run.model)
    held = _held_mb(loop)
    result.figures = Figures(
        loop.speed.speed(),
        loop.policy.regime,
        state.micro,
        loop.batches.per_step // world.size,
        run.cfg.compile,
        adapters.trainable_parameters(run.model),
        None if first_step is None else round(first_step, 3),
        world.size if world.size > 1 else None,
        digests,
        "fsdp" if loop.parts.sharded else None,
        held,
        round(loop.validating, 3),
        _held_on_device(loop),
        point_rows=len(loop.point_data.validation) if loop.point_data is not run.data else None,
        final_rows=loop.final_rows,
    )
    if world.is_main:
        loop.reporter.measured(result.figures)
        # Reports went out in the background (report_queue.py): the search must have them all
        # before the worker tells it how the run ended.
        loop.reporter.flush()
    return result


def _held_on_device(loop: Loop) -> float:
    """Figures.held_mb: CUDA's peak allocation; on CPU the weights, optimizer state and gradients (their size)."""
    device = loop.run.device
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 3)
    mine = held.held_bytes(loop.parts.model, loop.parts.optimizer)
    return round((mine["parameters"] + mine["optimizer"] + mine["trained"]) / 2**20, 3)


def _held_mb(loop: Loop) -> list[float] | None:
    """With several ranks, the parameters and optimizer state each rank held at the end, measured from its
    tensors (a sharded rank's: its shards)."""
    if loop.run.world.size == 1:
        return None
    mine = held.held_bytes(loop.parts.model, loop.parts.optimizer)
    each = loop.run.world.gather((mine["parameters"] / 2**20, mine["optimizer"] / 2**20))
    if loop.run.world.rank == 0:  # one line for the group, in rank 0's log (a peer logs only what went wrong)
        # Measured after the last step, when its gradients are freed: they are in no rank's figure.
        ranks = "; ".join(f"rank {r} {p:.1f} + {o:.1f} MB" for r, (p, o) in enumerate(each))
        log.info("held at the end, from each rank's own tensors (parameters + optimizer state): %s", ranks)
    return [round(p + o, 3) for p, o in each]


def _rank_digests(world: World, speed: Throughput, model: torch.nn.Module) -> list[str] | None:
    """With several ranks, each rank's parameter digest (equal: data parallelism kept the ranks'
    parameters identical; None for sharded ranks, which hold different parts), and ``speed`` summed
    over every rank."""
    if world.size == 1:
        return None
    digest = "" if sharding.is_sharded(model) else parameter_digest(model)
    counts = world.gather((speed.examples, speed.tokens, speed.padded, digest))
    speed.examples, speed.tokens, speed.padded = (sum(c[k] for c in counts) for k in range(3))
    digests = [c[3] for c in counts]
    if not digest:
        return None
    log.info("rank %d of %d: parameter digest %s", world.rank, world.size, digest)
    if len(set(digests)) > 1:
        log.error("the ranks' parameters differ (digests %s)", digests)
    return digests


def _meta(run: Run, metrics: Metrics, step: int) -> dict[str, Any]:
    values = {f"val_{k}": v for k, v in metrics.values().items()}
    meta = {**run.meta, "step": step, **values, "train": vars(run.cfg)}
    if run.data.labels is not None:
        # An adapter folder has no config.json to hold them: a merged export names its labels from here.
        meta["id2label"] = {str(k): v for k, v in run.data.labels.id2label().items()}
        if run.data.labels.problem_type is not None:
            meta["problem_type"] = run.data.labels.problem_type
    return meta
