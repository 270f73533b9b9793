"""A worker process (a spawned child, see dispatch.py): ask -> train -> tell on one device until the budget
is used, with the tokenizer, data and pre-trained weights loaded once for every trial it runs."""

from __future__ import annotations

import functools
import logging
import signal
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import optuna
from optuna.trial import TrialState

from hpsearch.search.cli import main as cli
from hpsearch.search.errors import SpecError
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.presets import resolved
from hpsearch.search.study import budget, objectives, sampling
from hpsearch.search.study.spec import BUDGET_KEYS, StudySpec, difference
from hpsearch.search.workers import attempt, ranks, reap, retry, stop_signals, sweep
from hpsearch.search.workers.devices import torch_device
from hpsearch.search.workers.outcome import Outcome
from hpsearch.search.workers.reap import Reaper
from hpsearch.search.workers.record import TrialRecord
from hpsearch.storage import attrs, liveness, registry, retention, slots
from hpsearch.storage.db import OUTAGE_RETRY
from hpsearch.storage.errors import StorageError
from hpsearch.storage.liveness import MISSED_BEATS
from hpsearch.storage.open import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    study: str
    storage_url: str
    device: str  # "cpu" or "cuda" (the parent narrows CUDA_VISIBLE_DEVICES to this worker's GPU)
    name: str  # unique: host/device/pid-ish, recorded on every trial it runs
    output_dir: str
    spec: dict[str, Any]  # StudySpec.to_dict() of the spec `start` or `worker` checked: the only one this worker runs
    threads: int | None = None
    log_level: int = logging.INFO
    device_label: str = ""  # as the registry shows it ("cuda:1", "cpu:0", "cuda:0+1"); defaults to device
    peer_devices: tuple[str, ...] = ()  # the group's other devices, one peer rank each (Device.child_ids)


def main(args: WorkerArgs, conn: Connection | None = None) -> None:
    """Entry point of the spawned worker process."""
    try:
        _serve(args, conn)
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    if args.peer_devices and isinstance(code, int):
        from hpsearch.trainer import distributed

        # The supervisor reads this code (a smaller group's restart, a stop): not a SIGABRT in the shutdown instead.
        distributed.end_process(code)
    if code:
        raise SystemExit(code)


def _serve(args: WorkerArgs, conn: Connection | None) -> None:
    """Register, then ask, train and tell until the budget is used or a stop; an exit code other than 0 is a
    SystemExit, read by the supervisor (search/exit_codes.py)."""
    cli.setup_logging(args.log_level, args.name)
    stop = stop_signals.StopFlag()
    stop.install()
    if not stop_signals.die_with_parent():
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

    # A device group's peer ranks start first and join this rank's process group, for every trial (ranks.py).
    peers = None
    if args.peer_devices:
        peers = ranks.Peers(args.device, args.peer_devices, args.name, args.output_dir, args.threads)
    world = peers.start(torch_device(args.device)) if peers else World()
    outage_retry = replace(OUTAGE_RETRY, give_up=stop.outage_retry_over)
    try:
        storage = stop_signals.open_retrying(args.storage_url, outage_retry, stop)
    except stop_signals.StorageLost as exc:
        _exit(ExitCode.STORAGE_LOST, f"{exc}; exiting", peers)
    if storage is None:
        _exit(ExitCode.signalled(stop.signum), "stopped before the storage answered", peers)
    try:
        # Registered (and heartbeating) from the start, so status shows a worker still loading.
        with registry.Registration(storage.db, args.study, args.name, args.device_label or args.device) as reg:
            worker = Worker(args, storage, stop, conn, registration=reg, world=world, peers=peers)
            # Every worker also reaps trials of workers that vanished (see reap.py).
            with Reaper(storage, args.study, max_retries=worker.spec.search.max_retries, interval_s=reg.interval_s):
                worker.run()
    except ranks.GroupRestart as exc:
        _exit(exc.code, f"{exc}; restarting the device group", peers)
    except Exception as exc:
        if not isinstance(exc, stop_signals.StorageLost) and not stop_signals.is_storage_failure(exc):
            raise
        # Also a storage call outside a trial (reading the spec) out of retries after a stop: one line, no traceback.
        why = f"{stop_signals.describe(exc)}; exiting (a held trial is retried once the storage is back)"
        _exit(ExitCode.STORAGE_LOST, why, peers)
    finally:
        storage.close()
    if peers:
        peers.close()
        world.close()
    if stop.requested:
        # Tell the supervisor we were stopped (our trial is handed back already): it restarts us unless stopping too.
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
        stop: stop_signals.StopFlag,
        conn: Connection | None,
        registration: registry.Registration | None = None,
        world: Any = None,
        peers: ranks.Peers | None = None,
    ) -> None:
        from hpsearch.trainer.adapters import quantization_config
        from hpsearch.trainer.distributed import World
        from hpsearch.trainer.model import PretrainedCache, load_tokenizer

        self.args, self.storage, self.stop, self.conn = args, storage, stop, conn
        self.registration = registration
        self.world: World = world or World()
        self.peers = peers
        self.launched = StudySpec.from_dict(args.spec)  # checked again: cheap, and a worker may be started by hand
        self.spec: StudySpec = resolved(self.launched, Path(args.output_dir))
        self._told_of_change = False
        place = args.name.rsplit("/", 1)[0]  # host/device, without the pid
        study_id = storage.optuna.get_study_id_from_name(args.study)
        seed = sampling.worker_seed(self.spec, place, len(storage.optuna.get_all_trials(study_id, deepcopy=False)))
        sampler, pruner = sampling.make_sampler(self.spec, seed), sampling.make_pruner(self.spec)
        self.study = optuna.load_study(study_name=args.study, storage=storage.optuna, sampler=sampler, pruner=pruner)
        self.device = torch_device(args.device)
        self.tokenizer = load_tokenizer(self.spec.model.name)
        # One base per worker; with [adapter], every trial's adapter goes onto that same one.
        self.models = PretrainedCache(quantization_config(self.spec.model))
        self.root = Path(args.output_dir) / args.study

    @functools.cached_property
    def data(self) -> Any:
        from hpsearch.trainer.encoding import prepare

        # One token cache for every study under this output folder: the same inputs are tokenised once per host.
        cache, model = Path(self.args.output_dir) / "token-cache", self.spec.model
        return prepare(self.spec.data, self.tokenizer, model.max_length, cache, task=model.task)

    def run(self) -> None:
        finished = 0
        # A trial left RUNNING by a worker that died before the registry knew it has no heartbeat to go stale: it
        # would hold its slot (and use up gpu_hours) for ever. Failed and retried here, before the budget is judged.
        reap.retry_orphans(self.storage, self.args.study, max_retries=self.spec.search.max_retries)
        # Trials an earlier start on this host left running (killed, or stopped during an outage) are retried first.
        reap.retry_gone_here(self.storage, self.args.study, max_retries=self.spec.search.max_retries)
        self._tidy(retain=True)  # checkpoints may have fallen out of the top k while this host was away
        while not self.stop():
            self._follow_budget()
            stop_reason = budget.budget_left(self.storage, self.study, self.spec, self.storage.db.now())
            retries_only = stop_reason is not None
            if retries_only:
                # Trials that already started finish: a retry is not a new trial.
                waiting = retry.waiting_retries(self.study)
                if not waiting:
                    log.info("no new trial: %s; %d run here", stop_reason, finished)
                    return
                log.info("%s, but trial(s) %s started before: running their retries", stop_reason, waiting)
            n_trials = budget.n_trials(self.study, self.spec)
            slot = slots.claim_slot(self.storage.db, self.args.study, n_trials, self.args.name)
            if slot is None:
                if self._wait_for_missing_workers():
                    continue
                log.info("study budget (%d trials) is used; %d run here", n_trials, finished)
                return
            trial = retry.pop_retry(self.storage.optuna, self.study) if retries_only else self.study.ask()
            if trial is None:  # another worker took the last retry
                slots.release_slot(self.storage.db, self.args.study, slot=slot)
                continue
            record = self.record(trial)
            record.begin(slot, self.registration)
            self._notify("trial", trial._trial_id, trial.number)
            try:
                ended = attempt.run(record, self.bench())
                if ended is not None and ended is not Outcome.INTERRUPTED:
                    self.retain()
            except (ranks.GroupRestart, stop_signals.StorageLost):
                # GroupRestart (recorded; the ranks restart) and StorageLost (nothing can be recorded) end the worker.
                raise
            except Exception as exc:
                if stop_signals.is_storage_failure(exc):
                    raise stop_signals.StorageLost.during(trial.number, exc) from exc
                if not self.storage.optuna.get_trial(trial._trial_id).state.is_finished():
                    raise
                # Reaped meanwhile (see TrialRecord.end).
                log.warning("trial %d was reaped while it ran here; dropping this attempt", trial.number)
            # A trial cut short by a stop request is handed back, not finished here.
            record.leave(self.registration, finished=not self.stop())
            self._notify("idle", trial._trial_id, trial.number)
            self._tidy()
            finished += 1

    def _follow_budget(self) -> None:
        """Take the stored spec's budget keys (another `start --n-trials` may have raised them), and nothing else of
        it: this worker runs the spec it was started with. Any other change is a database writer's, said once."""
        stored = self.study.user_attrs.get(attrs.SPEC)
        try:
            theirs = StudySpec.from_dict(stored)
        except SpecError as exc:
            theirs, change = None, f"it is no longer a valid spec: {exc}"
        else:
            change = difference(theirs.identity(), self.launched.identity())  # stored, then given (launched)
        if change and not self._told_of_change:
            self._told_of_change = True
            log.warning(
                "study %s: the stored spec changed since this worker started (%s); ignored: a worker runs the spec "
                "it was started with (restart `hpsearch worker` to check and run a new one)",
                self.args.study,
                change,
            )
        if theirs is not None:
            self.spec.search = replace(self.spec.search, **{key: getattr(theirs.search, key) for key in BUDGET_KEYS})

    def record(self, trial: optuna.Trial) -> TrialRecord:
        """The record this worker writes of ``trial`` (search/workers/record.py)."""
        search = self.spec.search
        return TrialRecord(self.storage, self.study, trial, max_retries=search.max_retries, cost=search.cost)

    def bench(self) -> attempt.Bench:
        """What an attempt is given of this worker (attempt.py never calls back into it)."""
        label = attempt.device_name(self.world, self.device, self.args.device_label)
        return attempt.Bench(
            spec=self.spec,
            root=self.root,
            worker=self.args.name,
            device_label=label,
            device=self.device,
            world=self.world,
            tokenizer=self.tokenizer,
            data=lambda: self.data,
            models=self.models,
            peers=self.peers,
            stop=self.stop,
        )

    def _wait_for_missing_workers(self) -> bool:
        """True (after a pause, if needed) when the used-up budget may still free a slot here: a trial whose
        worker missed heartbeats may come back for a retry, and this worker should be there to run it. A slot
        whose worker vanished before the registry knew its trial is freed (or its trial retried) at once."""
        study, retries = self.args.study, self.spec.search.max_retries
        # Stale heartbeat rows are left to the Reaper thread, which knows our connection was healthy.
        reap.retry_orphans(self.storage, study, max_retries=retries)
        if slots.used_slots(self.storage.db, study) < budget.n_trials(self.study, self.spec):
            return True
        waiting = liveness.stale_trials(self.storage.db, study, missed_beats=1.5)
        if not waiting:
            return False
        msg = "waiting for trial(s) %s: their workers missed heartbeats (reaped after %d missed beats)"
        log.info(msg, ", ".join(str(w.trial_number) for w in waiting), MISSED_BEATS)
        interval = self.registration.interval_s if self.registration else registry.heartbeat_interval()
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not self.stop():
            time.sleep(0.2)
        return True

    def _tidy(self, *, retain: bool = False) -> None:
        """Sweep this host's folders (sweep.py) and, with ``retain``, delete checkpoints that left the top k."""
        try:
            if retain:
                self.retain()
            sweep.trial_folders(self.storage.optuna, self.study, self.root, max_retries=self.spec.search.max_retries)
        except (StorageError, OSError) as err:
            # A later trial's sweep tries again; tidying is never worth a failed worker.
            log.warning("could not sweep %s: %s", self.root, err)

    def retain(self) -> None:
        """Keep only the best checkpoints of the study's top trials (see storage/retention.py); in a two-objective
        study, the Pareto front's first."""
        retention.retain(
            self.storage.optuna,
            self.study.study_name,
            candidates(self.study, self.root),
            keep_top_k=self.spec.search.keep_top_k,
            minimize=self.spec.direction == "minimize",
            max_disk_gb=self.spec.search.max_disk_gb,
        )

    def _notify(self, *message: Any) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(message)
        except OSError:  # BrokenPipeError: the supervisor is gone
            if not self.stop():
                # Off Linux there is no parent-death signal; this is the same graceful stop.
                self.stop.request(signal.SIGTERM, "the supervisor is gone")


def candidates(study: optuna.Study, root: Path) -> list[retention.Candidate]:
    """The study's complete trials as retention ranks them, their checkpoints looked for under ``root``; in a
    two-objective study, the Pareto front's before the rest."""
    front = {t.number for t in objectives.front(study)}
    return [
        retention.candidate(
            t._trial_id, t.number, value, root, t.user_attrs, off_front=bool(front) and t.number not in front
        )
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        # Deleted ones keep their place in the ranking, so a worse one is not kept instead of one deleted for disk.
        if (value := objectives.quality(t)) is not None and t.user_attrs.get(attrs.BEST_CHECKPOINT)
    ]
