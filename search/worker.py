"""A worker process: ask -> train -> tell on one device until the study's budget is used.

Runs in a spawned child (see dispatch.py). It loads the tokenizer, the data and the
pre-trained weights once and keeps them for every trial it runs.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import optuna
from optuna.trial import TrialState

from hpsearch.search import cli, leftovers, lifeline, ranks, reap, retry, study as studies
from hpsearch.search.devices import torch_device
from hpsearch.search.early_stop import EarlyStop, PruningGate
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.presets import resolved
from hpsearch.search.reap import Reaper
from hpsearch.search.space import split_params
from hpsearch.search.spec import StudySpec
from hpsearch.search.trial_attrs import AttrReporter
from hpsearch.storage import attrs, budget, checkpoints as retention, lost, registry
from hpsearch.storage.db import PATIENT_RETRY
from hpsearch.storage.errors import StorageError
from hpsearch.storage.open import Storage
from hpsearch.storage.trialdir import LOG, TrialDir, TrialDirError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    study: str
    storage_url: str
    device: str
    """"cpu" or "cuda" (the parent narrows CUDA_VISIBLE_DEVICES to this worker's GPU)."""
    name: str
    """Unique worker name: host/device/pid-ish, recorded on every trial it runs."""
    output_dir: str
    threads: int | None = None
    log_level: int = logging.INFO
    device_label: str = ""
    """The device as the registry shows it ("cuda:1", "cpu:0", "cuda:0+1"); defaults to ``device``."""
    peer_devices: tuple[str, ...] = ()
    """The other devices of this worker's group (train.devices_per_trial > 1), one peer rank each,
    as ``Device.child_ids`` names them."""


class TrialReporter(AttrReporter):
    """The trainer's Reporter, backed by an Optuna trial."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        self.last_ok = time.monotonic()
        """When a call last reached the storage: the device time of an attempt that storage
        failed is counted up to here, not through the minutes of retrying."""

    def report(self, value: float, step: int, metrics: object = None) -> None:
        self.trial.report(value, step)
        self.last_ok = time.monotonic()

    def should_prune(self) -> bool:
        prune = self.trial.should_prune()
        self.last_ok = time.monotonic()
        return prune

    def set_attrs(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self.trial.set_user_attr(key, value)
        self.last_ok = time.monotonic()


def main(args: WorkerArgs, conn: Connection | None = None) -> None:
    """Entry point of the spawned worker process."""
    cli.setup_logging(args.log_level, args.name)
    stop = lifeline.StopFlag()
    stop.install()
    if not lifeline.die_with_parent():
        log.warning("the supervisor that started this worker is gone; exiting")
        raise SystemExit(ExitCode.signalled(signal.SIGTERM))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        # TF32 tensor cores for fp32 matmuls: ~free speed on Ampere and newer.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from hpsearch.trainer.distributed import World

    # A device group's peer ranks start first and join this rank's process group; they stay
    # for every trial of this worker (see ranks.py).
    peers = None
    if args.peer_devices:
        peers = ranks.Peers(args.device, args.peer_devices, args.name, args.output_dir, args.threads)
    world = peers.start(torch_device(args.device)) if peers else World()
    patience = replace(PATIENT_RETRY, give_up=stop.storage_patience_over)
    try:
        storage = lifeline.open_patiently(args.storage_url, patience, stop)
    except lifeline.StorageLost as exc:
        _exit(ExitCode.STORAGE_LOST, f"{exc}; exiting", peers)
    if storage is None:
        _exit(128 + stop.signum, "stopped before the storage answered", peers)
    try:
        # Registered (and heartbeating) from the start, so status shows a worker still loading.
        device = args.device_label or args.device
        with registry.Registration(storage.db, args.study, args.name, device) as reg:
            worker = Worker(args, storage, stop, conn, registration=reg, world=world, peers=peers)
            # Every worker also reaps trials of workers that vanished (see reap.py).
            with Reaper(storage, args.study, max_retries=worker.spec.search.max_retries, interval_s=reg.interval_s):
                worker.run()
    except ranks.GroupRestart as exc:
        _exit(ExitCode.GROUP_RESTART, f"{exc}; restarting the device group", peers)
    except Exception as exc:
        if not isinstance(exc, lifeline.StorageLost) and not lifeline.is_storage_failure(exc):
            raise
        # Also a storage call outside a trial (reading the spec while loading) that ran out
        # of patience after a stop: one line, not a traceback.
        _exit(
            ExitCode.STORAGE_LOST,
            f"{lifeline.describe(exc)}; exiting (a held trial is retried once the storage is back)",
            peers,
        )
    finally:
        storage.close()
    if peers:
        peers.close()
        world.close()
    if stop.requested:
        # Tell the supervisor we were stopped (its trial is already handed back), so it
        # restarts us unless it is stopping too.
        raise SystemExit(ExitCode.signalled(stop.signum))


def _exit(code: int, why: str, peers: ranks.Peers | None) -> NoReturn:
    log.error("%s", why)
    if peers:
        peers.close(kill=True)
    raise SystemExit(code)


class Worker:
    def __init__(
        self,
        args: WorkerArgs,
        storage: Storage,
        stop: lifeline.StopFlag,
        conn: Connection | None,
        registration: registry.Registration | None = None,
        world: Any = None,
        peers: ranks.Peers | None = None,
    ) -> None:
        from hpsearch.trainer.distributed import World
        from hpsearch.trainer.model import PretrainedCache, load_tokenizer

        self.args, self.storage, self.stop, self.conn = args, storage, stop, conn
        self.registration = registration
        self.world: World = world or World()
        self.peers = peers
        self.spec: StudySpec = resolved(studies.stored_spec(storage, args.study), Path(args.output_dir))
        place = args.name.rsplit("/", 1)[0]  # host/device, without the pid
        n_existing = len(
            storage.optuna.get_all_trials(storage.optuna.get_study_id_from_name(args.study), deepcopy=False)
        )
        seed = studies.worker_seed(self.spec, place, n_existing)
        self.study = optuna.load_study(
            study_name=args.study,
            storage=storage.optuna,
            sampler=studies.make_sampler(self.spec, seed),
            pruner=studies.make_pruner(self.spec),
        )
        self.device = torch_device(args.device)
        self.tokenizer = load_tokenizer(self.spec.model.name)
        from hpsearch.trainer.adapters import quantization_config

        # One base per worker; with [adapter], every trial's adapter goes onto that same one.
        self.models = PretrainedCache(quantization_config(self.spec.model))
        self.root = Path(args.output_dir) / args.study
        self._data: Any = None

    def data(self) -> Any:
        from hpsearch.trainer.dataset import prepare

        if self._data is None:
            # One cache folder for every study under this output folder: same files, same
            # tokenizer and max_length are tokenised once per host, whatever the study.
            cache = Path(self.args.output_dir) / "token-cache"
            model = self.spec.model
            self._data = prepare(self.spec.data, self.tokenizer, model.max_length, cache, task=model.task)
        return self._data

    def run(self) -> None:
        finished = 0
        # A trial left RUNNING by a worker that died before the registry knew it has no
        # heartbeat to go stale: it would hold its slot (and, counted as running, use up
        # gpu_hours) for ever. Failed and retried here, before the budget is judged.
        reap.reap(self.storage, self.args.study, max_retries=self.spec.search.max_retries, orphans=True, stale=False)
        # Trials that an earlier start on this host left running (killed with its instance, or
        # stopped while the database was away) are retried now, before a new one is asked for.
        reap.reap_gone_here(self.storage, self.args.study, max_retries=self.spec.search.max_retries)
        self._tidy(retain=True)  # checkpoints may have fallen out of the top k while this host was away
        while not self.stop():
            stop_reason = studies.budget_left(self.study, self.spec, self.storage.db.now())
            retries_only = stop_reason is not None
            if retries_only:
                # Trials that already started finish: a retry is not a new trial.
                waiting = retry.waiting_retries(self.study)
                if not waiting:
                    log.info("no new trial: %s; %d run here", stop_reason, finished)
                    return
                log.info("%s, but trial(s) %s started before: running their retries", stop_reason, waiting)
            n_trials = studies.n_trials(self.study, self.spec)
            slot = budget.claim_slot(self.storage.db, self.args.study, n_trials, self.args.name)
            if slot is None:
                if self._wait_for_missing_workers():
                    continue
                log.info("study budget (%d trials) is used; %d run here", n_trials, finished)
                return
            trial = retry.pop_retry(self.study) if retries_only else self.study.ask()
            if trial is None:  # another worker took the last retry
                budget.release_slot(self.storage.db, self.args.study, slot=slot)
                continue
            self._begin(trial, slot)
            try:
                self.run_trial(trial)
            except (ranks.GroupRestart, lifeline.StorageLost):
                # GroupRestart: the failure is recorded; the device group's ranks must start
                # afresh. StorageLost: nothing can be recorded; the worker exits.
                raise
            except Exception as exc:
                if lifeline.is_storage_failure(exc):
                    raise lifeline.StorageLost.during(trial.number, exc) from exc
                if not self._finished_elsewhere(trial):
                    raise
                # Our heartbeat went stale (a long network cut) and a reaper failed the trial
                # and queued a retry; the retry owns it now, so this attempt's result is dropped.
                log.warning("trial %d was reaped while it ran here; dropping this attempt", trial.number)
            if self.registration:
                # A trial cut short by a stop request is handed back, not finished here.
                self.registration.trial_ended(finished=not self.stop())
            self._notify("idle", trial._trial_id, trial.number)
            self._tidy()
            finished += 1

    def _begin(self, trial: optuna.Trial, slot: int) -> None:
        """Bind the trial to its slot and to this worker's registry row, then tell the supervisor.

        Until the registry row names the trial, nothing would ever notice this worker dying
        with it (no heartbeat covers it): a failure in between hands the trial back here.
        """
        try:
            budget.bind_slot(self.storage.db, self.args.study, slot, trial.number)
            if self.registration:
                self.registration.trial_started(trial.number)
        except BaseException:
            log.error("trial %d could not be registered; handing it back", trial.number)
            self._hand_back_unstarted(trial)
            raise
        self._notify("trial", trial._trial_id, trial.number)

    def _hand_back_unstarted(self, trial: optuna.Trial) -> None:
        try:
            retry.hand_back(
                self.storage,
                self.study,
                trial._trial_id,
                reason="not_started",
                resume_from=None,
                max_retries=self.spec.search.max_retries,
            )
        except StorageError as err:
            # Left RUNNING: the orphan sweep of the next worker to start fails and retries it.
            log.warning("could not hand trial %d back: %s", trial.number, err)

    def _wait_for_missing_workers(self) -> bool:
        """True (after a pause, if needed) when the used-up budget may still free a slot here.

        A trial whose worker missed heartbeats may come back for a retry, and this worker
        should be there to run it rather than leave the study a trial short. A worker that
        vanished before the registry knew its trial leaves no stale row, only a slot: that
        one is freed (or its trial retried) at once.
        """
        study, retries = self.args.study, self.spec.search.max_retries
        # Stale heartbeat rows are left to the Reaper thread, which knows our connection was healthy.
        reap.reap(self.storage, study, max_retries=retries, orphans=True, stale=False)
        if budget.used_slots(self.storage.db, study) < studies.n_trials(self.study, self.spec):
            return True
        waiting = lost.stale_trials(self.storage.db, study, missed_beats=1.5)
        if not waiting:
            return False
        log.info(
            "waiting for trial(s) %s: their workers missed heartbeats (reaped after %d missed beats)",
            ", ".join(str(w.trial_number) for w in waiting),
            registry.MISSED_BEATS,
        )
        interval = self.registration.interval_s if self.registration else registry.heartbeat_interval()
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not self.stop():
            time.sleep(0.2)
        return True

    def _finished_elsewhere(self, trial: optuna.Trial) -> bool:
        return self.storage.optuna.get_trial(trial._trial_id).state.is_finished()

    def run_trial(self, trial: optuna.Trial) -> None:
        from hpsearch.trainer.checkpoint import CheckpointError
        from hpsearch.trainer.loop import Run, fit

        params = studies.suggest(trial, self.spec)
        train_params, adapter_params = split_params(params)  # "adapter.r" -> [adapter] r
        cfg = replace(self.spec.train, **train_params)
        adapter = replace(self.spec.adapter, **adapter_params)
        folder = TrialDir(self.root, trial.number)
        try:
            out_dir = folder.make()
        except TrialDirError as exc:
            log.error("trial %d cannot start: %s", trial.number, exc)
            self._fail(trial, f"trial_dir_refused ({exc})"[:500])
            return
        reporter = TrialReporter(trial)
        # Where the resumable state goes, on record before the first one is written: a stop
        # during a database outage saves one that no later call could name (see reap.py).
        state = folder.state
        reporter.set_attrs(
            {
                attrs.DEVICE: self._device_name(),
                attrs.HOST: registry.this_host(),
                attrs.WORKER: self.args.name,
                attrs.RESUME_CHECKPOINT: str(state.resolve()),
            }
        )
        resume = retry.take_over(self.storage, self.args.study, trial, folder)
        handler = _trial_log(out_dir)
        log.info("trial %d starts: %s", trial.number, params)
        started = time.monotonic()  # first_step_seconds and device time count from here
        model: Any = None
        try:
            if self.peers is not None:
                # First, so the peers prepare their copy while this rank prepares its own.
                spec = self.spec
                resume_from = str(resume) if resume else None
                job = ranks.TrialJob(
                    trial.number, spec.model, spec.data, cfg, spec.search.metric, str(out_dir), resume_from
                )
                self.peers.run(job)
            data = self.data()
            model = self.models.trial_model(self.spec.model.name, data.labels, cfg.seed, adapter)
            run = Run(
                model=model,
                tokenizer=self.tokenizer,
                data=data,
                cfg=cfg,
                metric=self.spec.search.metric,
                device=self.device,
                out_dir=out_dir,
                resume_from=resume,
                should_stop=self.stop,
                stop_waiting=self.stop.storage_patience_over,
                meta={"study": self.args.study, "trial": trial.number, "params": params},
                started=started,
                world=self.world,
            )
            gate = PruningGate.of_search(data, cfg, self.spec.search)
            early = EarlyStop(reporter, gate)
            result = fit(run, early)
            result.fail_reason = result.fail_reason or early.reason
        except CheckpointError as exc:
            log.error("trial %d failed: %s", trial.number, exc)
            failure: str | None = exc.reason
        except Exception as exc:
            if lifeline.is_storage_failure(exc):
                # The database, not the trial: keep its checkpoints and hand it back.
                log.error("trial %d: the storage failed: %s", trial.number, lifeline.describe(exc))
                self._hand_back_after_storage_failure(trial, state, reporter, started, exc)
                return
            log.error("trial %d failed:\n%s", trial.number, traceback.format_exc())
            failure = f"{type(exc).__name__}: {exc}"[:500]
        else:
            failure = None
        finally:
            if model is not None:
                # The shared base gets its adapter taken off, ready for the next trial's.
                self.models.release(model)
            logging.getLogger().removeHandler(handler)
            handler.close()
        # Device time of this attempt (x its devices), added to earlier attempts' (the gpu_hours
        # budget); recorded before the trial is told, since a finished trial takes no more attributes.
        spent = (time.monotonic() - started) * self.world.size
        trial.set_user_attr(attrs.DEVICE_SECONDS, round(trial.user_attrs.get(attrs.DEVICE_SECONDS, 0.0) + spent, 3))
        ended = "failed" if failure is not None else result.status  # an error is not retried
        if ended in ("pruned", "failed"):
            # Never in the top k: only complete trials compete for a kept checkpoint.
            folder.remove(folder.best)
            if trial.user_attrs.get(attrs.BEST_CHECKPOINT):
                trial.set_user_attr(attrs.BEST_CHECKPOINT, f"{retention.DELETED_PREFIX} (trial {ended})")
        if ended != "interrupted":
            # The resumable state is only for a retry of an interrupted attempt.
            folder.remove(folder.resume)
        if failure is not None:
            self._fail(trial, failure)
            if self.world.size > 1:
                raise ranks.GroupRestart(f"trial {trial.number} failed on a {self.world.size}-device group")
            return
        if result.status == "complete" and result.best_value is not None:
            self._tell(trial, result.best_value)
            log.info(
                "trial %d complete: %s = %.4f at step %s",
                trial.number,
                self.spec.search.metric,
                result.best_value,
                result.best_step,
            )
        elif result.status == "pruned":
            if result.fail_reason:
                trial.set_user_attr(attrs.FAIL_REASON, result.fail_reason)
            self._tell(trial, state=TrialState.PRUNED)
            log.info(
                "trial %d pruned at step %d%s",
                trial.number,
                result.steps,
                f" ({result.fail_reason})" if result.fail_reason else "",
            )
        elif result.status == "interrupted":
            retry.hand_back(
                self.storage,
                self.study,
                trial._trial_id,
                reason="interrupted",
                resume_from=state,
                max_retries=self.spec.search.max_retries,
            )
        else:
            self._fail(trial, result.fail_reason or "no validation point reached")
        if result.status != "interrupted":
            self._retain()

    def _hand_back_after_storage_failure(
        self, trial: optuna.Trial, state: Path, reporter: TrialReporter, started: float, exc: Exception
    ) -> None:
        """Queue a retry that resumes from the trial's resumable state, like a crash.

        The retry waits until the storage answers again (each call retries patiently); if it
        does not, ``StorageLost`` ends the worker and the trial is reaped later.
        """
        # Counted up to the storage's last answer: training may have gone on through the outage
        # (see trainer/courier.py), but so may a run that ended and waited for its record.
        spent = (reporter.last_ok - started) * self.world.size
        try:
            before = float(trial.user_attrs.get(attrs.DEVICE_SECONDS, 0.0))
            trial.set_user_attr(attrs.DEVICE_SECONDS, round(before + max(0.0, spent), 3))
            retry.hand_back(
                self.storage,
                self.study,
                trial._trial_id,
                reason=f"storage_error ({type(exc).__name__})",
                resume_from=state,
                max_retries=self.spec.search.max_retries,
            )
        except Exception as err:
            if not lifeline.is_storage_failure(err):
                raise
            raise lifeline.StorageLost.during(trial.number, err) from err
        if self.world.size > 1:
            raise ranks.GroupRestart(f"trial {trial.number} lost its storage on a {self.world.size}-device group")

    def _tidy(self, *, retain: bool = False) -> None:
        """Delete what no trial needs from this host's folders (see leftovers.py), and, with
        ``retain``, the checkpoints that fell out of the top k (maybe while this host was away)."""
        try:
            if retain:
                self._retain()
            leftovers.sweep(self.storage.db, self.study, self.root, max_retries=self.spec.search.max_retries)
        except (StorageError, OSError) as err:
            # A later trial's sweep tries again; tidying is never worth a failed worker.
            log.warning("could not sweep %s: %s", self.root, err)

    def _retain(self) -> None:
        """Keep only the best checkpoints of the study's top trials (see storage/checkpoints.py)."""
        search, attr = self.spec.search, attrs.BEST_CHECKPOINT
        candidates = [
            retention.candidate(t._trial_id, t.number, float(t.value), self.root, t.user_attrs)
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            # Deleted ones stay in the ranking (their path no longer exists): a trial deleted for
            # the disk cap keeps its place, so a worse one is not kept instead.
            if t.value is not None and t.user_attrs.get(attr)
        ]
        retention.retain(
            self.storage.db,
            candidates,
            keep_top_k=search.keep_top_k,
            minimize=self.spec.direction == "minimize",
            max_disk_gb=search.max_disk_gb,
        )

    def _tell(self, trial: optuna.Trial, value: float | None = None, state: TrialState | None = None) -> None:
        """``study.tell``, taking the grid sampler's end of the grid for what it is.

        Once every grid point has run, optuna's GridSampler calls ``study.stop()`` from
        ``after_trial``, which raises RuntimeError outside ``study.optimize``; and with one
        point left, it reads the trial's grid index, which a retry or an enqueued trial (fixed
        parameters) lacks: KeyError. The trial is stored all the same (tell writes its state in
        a ``finally``), so neither is a failure: without this they passed for "the trial was
        reaped" and retention was skipped.
        """
        try:
            self.study.tell(trial, value, state=state)
        except (RuntimeError, KeyError):
            if not isinstance(self.study.sampler, optuna.samplers.GridSampler):
                raise
            stored = self.storage.optuna.get_trial(trial._trial_id).state
            if stored != (state or TrialState.COMPLETE):
                raise
            # The budget, not the sampler, ends the search: a failed point's retry may wait.
            log.info("trial %d was the last point of the grid", trial.number)

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr(attrs.FAIL_REASON, reason)
        self._tell(trial, state=TrialState.FAIL)

    def _device_name(self) -> str:
        if self.world.size > 1:
            return self.args.device_label
        if self.device.type == "cuda":
            import torch

            return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')} ({torch.cuda.get_device_name(0)})"
        return "cpu"

    def _notify(self, *message: Any) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(message)
        except OSError:  # BrokenPipeError: the supervisor is gone
            if not self.stop():
                # Off Linux there is no parent-death signal; this is the same graceful stop.
                self.stop.request(signal.SIGTERM, "the supervisor is gone")


def _trial_log(out_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(out_dir / LOG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler
