"""One attempt of a trial on a worker: train it with the trainer's ``fit``, then end it.

How it ended is the worker's to name; what that means for the trial is outcome.py's table."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna

from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.study import sampling
from hpsearch.search.study.space import split_params
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers import early_stop, ranks, stop_signals
from hpsearch.search.workers.early_stop import EarlyStop, PruningGate
from hpsearch.search.workers.outcome import Outcome
from hpsearch.search.workers.record import TrialRecord
from hpsearch.storage import attrs, registry
from hpsearch.storage.trialdir import TrialDir
from hpsearch.trainer.config import AdapterConfig, ConfigError, TrainConfig
from hpsearch.trainer.errors import RankOutOfMemory, is_disk_full
from hpsearch.trainer.report import FailReason, Status

log = logging.getLogger(__name__)
PEER_NEWS_S = 2.0  # how long a rank 0 whose collective failed waits to see whether a peer died


ENDED = {
    Status.COMPLETE: Outcome.COMPLETE,
    Status.PRUNED: Outcome.PRUNED,
    Status.FAILED: Outcome.FAILED,
    Status.INTERRUPTED: Outcome.INTERRUPTED,
}
"""What a run's end, as the trainer returns it, is for the trial (outcome.py's table says the rest)."""


@dataclass(frozen=True)
class Bench:
    """Where an attempt runs, as its worker set it up: plain values, so that attempt.py never calls back into
    the worker."""

    spec: StudySpec  # the spec the worker runs (its budget keys followed)
    root: Path  # this host's study folder: the trial's folder is in it
    worker: str  # the worker's name, host/device/pid
    device_label: str  # the device (group) as a trial records it: "cuda:1 (NVIDIA H200)", "cpu", "cpu:0+1"
    device: Any  # torch.device
    world: Any  # trainer/distributed.py World: this rank of its device group
    tokenizer: Any
    data: Callable[[], Any]  # the worker's tokenised data, prepared at its first trial (its errors fail that one)
    models: Any  # trainer/model.py PretrainedCache: the frozen base, loaded once per worker
    peers: ranks.Peers | None
    stop: stop_signals.StopFlag


def run(record: TrialRecord, w: Bench) -> Outcome | None:
    """Train one attempt of the record's trial on ``w`` and end it (see outcome.py); how it ended, None where it
    failed before a result or someone else ended it meanwhile (the worker then keeps its retention for later)."""
    import torch

    trial = record.trial

    from hpsearch.trainer.checkpoint import CheckpointError, RunFiles
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.points import PointRows

    try:
        params, cfg, adapter = trial_config(w.spec, trial)
    except (ValueError, TypeError) as exc:  # ConfigError among them
        # An enqueued trial's fixed parameters are a database row: a bad one fails this trial, never the worker.
        log.error("trial %d has parameters no trial of this spec can take: %s", trial.number, exc)
        record.end(Outcome.FAILED, reason=FailReason.BAD_PARAMS, detail=f"{type(exc).__name__}: {exc}")
        return None
    folder = TrialDir(w.root, trial.number)
    try:
        folder.make()
        log_file = folder.open_log()  # the trial's own log
    except OSError as exc:  # TrialDirError: a link or a file in the trial folder's place
        log.error("trial %d cannot start: %s", trial.number, exc)
        record.end(Outcome.FAILED, reason=FailReason.TRIAL_DIR_REFUSED, detail=str(exc))
        return None
    folder.unlink_link(folder.curves)
    files = RunFiles(best=folder.best, state=folder.state, curves=folder.curves, out_of_memory=folder.out_of_memory)
    where = {attrs.DEVICE: w.device_label, attrs.HOST: registry.this_host(), attrs.WORKER: w.worker}
    where[attrs.THREADS] = torch.get_num_threads()
    # Where the resumable state goes, on record before the first one is written: a stop
    # during a database outage saves one that no later call could name (see reap.py).
    record.set_attrs(where | {attrs.RESUME_CHECKPOINT: str(folder.state.resolve())})
    resume = record.take_over(folder)
    handler = logging.StreamHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    log.info("trial %d starts: %s", trial.number, params)
    started = time.monotonic()  # first_step_seconds and device time count from here
    model: Any = None
    out_of_memory: RankOutOfMemory | None = None
    try:
        early_points = early_stop.early_points(w.spec, cfg, w.data())
        if w.peers is not None:
            # First, so the peers prepare their copy while this rank prepares its own.
            spec = w.spec
            resume_from = str(resume) if resume else None
            job = ranks.TrialJob(
                trial.number, spec.model, spec.data, cfg, spec.search.quality, files, resume_from, adapter, early_points
            )
            w.peers.run(job)
        data = w.data()
        # A sharded trial's base turns into shards: it gets its own copy, not the worker's shared one.
        model = w.models.trial_model(
            w.spec.model.name, data.labels, cfg.seed, adapter, private=cfg.sharding != "none", precision=cfg.precision
        )
        run = Run(
            model=model,
            tokenizer=w.tokenizer,
            data=data,
            cfg=cfg,
            metric=w.spec.search.quality,
            device=w.device,
            files=files,
            resume_from=resume,
            should_stop=w.stop,
            stop_waiting=w.stop.outage_retry_over,
            meta={"study": record.study.study_name, "trial": trial.number, "params": params},
            started=started,
            world=w.world,
            early=early_points,
            point_rows=PointRows.of(w.spec.data),
        )
        gate = PruningGate.of_search(
            data, cfg, w.spec.search, rank_searched=w.spec.searches_rank, early=early_points.steps
        )
        early = EarlyStop(record.reporter, gate)
        result = fit(run, early)
        result.fail_reason = result.fail_reason or early.reason
    except CheckpointError as exc:
        log.error("trial %d failed: %s", trial.number, exc)
        failure: tuple[FailReason, str | None] | None = (exc.reason, None)
    except RankOutOfMemory as exc:
        log.warning("trial %d: %s; the device group restarts with a smaller micro-batch", trial.number, exc)
        out_of_memory = exc
        failure = None
    except Exception as exc:
        if w.peers is not None and w.peers.one_died(PEER_NEWS_S):
            # A collective fails at once when a peer dies: its death (perhaps out of memory) is what ends the group.
            time.sleep(ranks.CLOSE_TIMEOUT_S)
        if stop_signals.is_storage_failure(exc):
            # The database, not the trial: keep its checkpoints and hand it back.
            log.error("trial %d: the storage failed: %s", trial.number, stop_signals.describe(exc))
            _hand_back_after_storage_failure(record, w, folder, exc)
            return None
        log.error("trial %d failed:\n%s", trial.number, traceback.format_exc())
        failure = public_reason(exc, folder)
    else:
        failure = None
    finally:
        if model is not None:
            # The shared base gets its adapter taken off, ready for the next trial's.
            w.models.release(model)
        logging.getLogger().removeHandler(handler)
        handler.close()
        log_file.close()
    if out_of_memory is not None:
        record.end(Outcome.OUT_OF_MEMORY, folder=folder, detail=str(out_of_memory))
        raise ranks.GroupRestart(f"trial {trial.number}: {out_of_memory}", ExitCode.OUT_OF_MEMORY)
    if failure is not None:
        record.end(Outcome.FAILED, folder=folder, reason=failure[0], detail=failure[1])
        if w.world.size > 1:
            raise ranks.GroupRestart(f"trial {trial.number} failed on a {w.world.size}-device group")
        return None
    ended, why = ENDED[result.status], result.fail_reason
    if ended is Outcome.COMPLETE and result.best_value is None:
        ended, why = Outcome.FAILED, FailReason.NO_VALIDATION_POINT
    if record.end(ended, folder=folder, reason=why, value=result.best_value) is None:
        return None
    if ended is Outcome.COMPLETE:
        msg = "trial %d complete: %s = %.4f at step %s"
        log.info(msg, trial.number, w.spec.search.quality, result.best_value, result.best_step)
    elif ended is Outcome.PRUNED:
        log.info("trial %d pruned at step %d%s", trial.number, result.steps, f" ({why.text})" if why else "")
    return ended


def trial_config(spec: StudySpec, trial: optuna.Trial) -> tuple[dict[str, Any], TrainConfig, AdapterConfig]:
    """The trial's parameters, checked against the spec's space, and the configurations they make (raises
    ValueError, ConfigError among them, for a parameter no trial of the spec can take: a row sets an enqueued
    trial's values, and Optuna hands a fixed value of the wrong type or range on as it is, or fails on it)."""
    params = sampling.suggest(trial, spec)
    for name, value in params.items():
        spec.space[name].check_value(value, f"parameter {name}")
    train_params, adapter_params = split_params(params)  # "adapter.r" -> [adapter] r
    cfg, adapter = replace(spec.train, **train_params), replace(spec.adapter, **adapter_params)
    cfg.validate()
    adapter.validate()
    return params, cfg, adapter


def public_reason(exc: BaseException, folder: TrialDir) -> tuple[FailReason, str | None]:
    """What the study records of an error that failed a trial. Nothing read on this host from a data or model file
    may leave it through the database (docs/decisions.md, "Nothing read on a worker's host leaves it"), and an
    error's message can quote a file: the record names the error and where it was raised; its message stays in the
    trial's train.log. A configuration error says only what the spec and the trial's parameters hold."""
    if is_disk_full(exc):
        return FailReason.DISK_FULL, None
    if isinstance(exc, ConfigError):
        return FailReason.CONFIG_ERROR, f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {_code_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return FailReason.ERROR, f"{type(exc).__name__}{where}; its message is in {folder.log} on {registry.this_host()}"


def _code_path(filename: str) -> str:
    """A source file as its package names it (peft/tuners/lora/model.py), not where this host installed it."""
    path = Path(filename)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor) + 1 :])
    return "/".join(path.parts[-2:])


def _hand_back_after_storage_failure(record: TrialRecord, w: Bench, folder: TrialDir, exc: Exception) -> None:
    """Queue a retry that resumes from the trial's resumable state, like a crash, once the storage answers
    again (each call retries through the outage); if it does not, ``StorageLost`` ends the worker."""
    # Counted up to the storage's last answer: training may have gone on through the outage
    # (see trainer/report_queue.py), but so may a run that ended and waited for its record.
    trial, ago = record.trial, time.monotonic() - record.reporter.last_ok
    try:
        record.end(Outcome.STORAGE_LOST, folder=folder, detail=type(exc).__name__, ago=ago)
    except Exception as err:
        if not stop_signals.is_storage_failure(err):
            raise
        raise stop_signals.StorageLost.during(trial.number, err) from err
    if w.world.size > 1:
        raise ranks.GroupRestart(f"trial {trial.number} lost its storage on a {w.world.size}-device group")


def device_name(world: Any, device: Any, group_label: str) -> str:
    """The device (group) as a trial records it (``attrs.DEVICE``)."""
    if world.size > 1:
        return group_label
    if device.type == "cuda":
        import torch

        return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')} ({torch.cuda.get_device_name(0)})"
    return "cpu"
