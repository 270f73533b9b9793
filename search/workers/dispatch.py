"""The supervisor: one spawned worker per device, and a record of every way one can end.

Like rq's work-horse supervision: the parent sees a child die at once (process sentinels), hands its
trial back for a retry, and restarts the child within a bound."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import optuna

from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.views import progress
from hpsearch.search.workers import outcome, retry, stop_signals, worker
from hpsearch.search.workers.devices import Device, only_gpu, threads_per_worker
from hpsearch.search.workers.outcome import Outcome
from hpsearch.storage import liveness, registry
from hpsearch.storage.errors import StorageError
from hpsearch.storage.open import Storage, open_storage
from hpsearch.storage.trialdir import TrialDir

log = logging.getLogger(__name__)
CRASH_LIMIT = 3
CRASH_WINDOW_S = 600.0
# How an unexpected exit is logged and recorded (fail_reason "worker_crash (...)"), by its exit code.
_DIED = {
    # The worker recorded its failed trial; its ranks start afresh (counted as a crash).
    ExitCode.GROUP_RESTART: "restart after a failed trial",
    ExitCode.PEER_DIED: "a peer rank died",
    # Its resumable state is on disk; the trial is handed back here, or reaped once the storage is back.
    ExitCode.STORAGE_LOST: "storage unreachable",
}


@dataclass
class Child:
    device: Device
    process: Any
    conn: Connection
    name: str
    trial: tuple[int, int] | None = None  # (trial_id, number) being run
    crashes: deque[float] = field(default_factory=deque)


class Supervisor:
    def __init__(
        self,
        study: str,
        storage_url: str,
        devices: list[Device],
        output_dir: Path,
        spec: StudySpec,
        log_level: int = logging.INFO,
    ) -> None:
        self.study, self.storage_url, self.devices = study, storage_url, devices
        # The spec `start` or `worker` checked: every worker (and every restart of one) is handed this one, never
        # the stored one, which a database writer may have changed since (docs/decisions.md).
        self.spec, self.output_dir, self.log_level = spec, output_dir, log_level
        self.ctx = mp.get_context("spawn")
        self.threads = threads_per_worker(devices)
        if self.threads is not None:
            log.info("each CPU worker trains with %d torch thread(s) (OMP_NUM_THREADS sets it)", self.threads)
        self.children: dict[int, Child] = {}  # keyed by sentinel
        self.stopping, self.stop_signal = 0, 0
        self.failed_devices: list[str] = []
        self.storage_lost = False  # a worker stopped without reaching the storage: nothing more is asked of it
        self.progress = progress.for_terminal(study, storage_url, spec)

    def run(self) -> int:
        """Run until every worker has finished; 0 if all ended cleanly, 1 if a device gave up."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.progress.start()
        try:
            for device in self.devices:  # each its own crash count: --devices names a device once
                self._spawn(device, deque())
            while self.children:
                ready = wait([*self.children, *(c.conn for c in self.children.values())], timeout=1.0)
                for obj in ready:
                    if isinstance(obj, int):
                        self._collect(obj)
                    else:
                        child = next((c for c in self.children.values() if c.conn is obj), None)
                        if child is not None:
                            self._receive(child)
                self.progress.tick(self.children.values())
        finally:
            self.progress.stop(storage_lost=self.storage_lost)
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.stopping:
            return 128 + self.stop_signal
        return 1 if self.failed_devices else 0

    def _spawn(self, device: Device, crashes: deque[float]) -> None:
        name = f"{registry.this_host()}/{device.label}/{os.getpid()}"
        ids = device.child_ids()
        args = worker.WorkerArgs(
            study=self.study,
            storage_url=self.storage_url,
            device=device.kind,
            name=name,
            output_dir=str(self.output_dir),
            spec=self.spec.to_dict(),
            threads=self.threads,
            log_level=self.log_level,
            device_label=device.label,
            peer_devices=ids[1:],  # the worker spawns a peer rank per other device of its group
        )
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=worker.main, args=(args, child_conn), name=f"hpsearch-{device.label}")
        with only_gpu(ids[0] if device.kind == "cuda" else None), self.progress.capture_output():
            process.start()
        child_conn.close()
        self.children[process.sentinel] = Child(device, process, parent_conn, name, crashes=crashes)
        log.info("worker %s started (pid %d)", name, process.pid)

    def _receive(self, child: Child) -> bool:
        """Read one message from the child; False once its end of the pipe is closed."""
        try:
            kind, trial_id, number = child.conn.recv()
        except (EOFError, OSError):
            return False
        child.trial = (trial_id, number) if kind == "trial" else None
        return True

    def _collect(self, sentinel: int) -> None:
        child = self.children.pop(sentinel)
        child.process.join()
        # Messages sent just before exit are still in the pipe.
        while child.conn.poll() and self._receive(child):
            pass
        child.conn.close()
        code = child.process.exitcode
        if code == 0:
            log.info("worker %s finished", child.name)
            return
        if code in (128 + signal.SIGTERM, 128 + signal.SIGINT) and child.trial is None:
            # A graceful stop: the worker checkpointed and handed its trial back itself.
            log.warning("worker %s was stopped by a signal after handing its trial back", child.name)
            if not self.stopping:
                self._spawn(child.device, child.crashes)
            return
        during = f" during trial {child.trial[1]}" if child.trial else ""
        if code == ExitCode.OUT_OF_MEMORY:
            # Not a crash: a rank recorded the micro-batch it ran out of memory at; the restarted group starts smaller.
            log.warning("worker %s: a rank ran out of memory%s; restarting its device group", child.name, during)
            self._record_crash(child, "a rank ran out of memory", Outcome.OUT_OF_MEMORY)
            if not self.stopping:
                self._spawn(child.device, child.crashes)
            return
        how = _DIED.get(code) or (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        if self.stopping and code == ExitCode.STORAGE_LOST:
            # It stopped after the storage went quiet: another try from here would only add
            # a connect timeout to the shutdown. The trial is reaped once the storage is back.
            log.warning("worker %s stopped without reaching the storage%s", child.name, during)
            self.storage_lost = True
            return
        log.error("worker %s died unexpectedly (%s)%s", child.name, how, during)
        self._record_crash(child, how)
        if self.stopping:
            return
        now = time.monotonic()
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > CRASH_WINDOW_S:
            child.crashes.popleft()
        if len(child.crashes) >= CRASH_LIMIT:
            msg = "worker on %s crashed %d times in %d minutes; giving that device up (see its trial logs)"
            log.error(msg, child.device.label, len(child.crashes), CRASH_WINDOW_S // 60)
            self.failed_devices.append(child.device.label)
            return
        self._spawn(child.device, child.crashes)

    def _record_crash(self, child: Child, how: str, ended: Outcome = Outcome.CRASHED) -> None:
        """End the dead child's registry row and hand its trial back for a retry."""
        try:
            # The parent holds no connection while its children train.
            with contextlib.closing(open_storage(self.storage_url, create=False)) as storage:
                self._hand_back_dead(storage, child, how, ended)
        except StorageError as err:
            # Its registry row stays open: the trial is reaped once the storage answers and its heartbeat is stale.
            msg = "could not hand back the trial of worker %s (it is retried once the storage is back): %s"
            log.error(msg, child.name, err)

    def _hand_back_dead(self, storage: Storage, child: Child, how: str, ended: Outcome) -> None:
        # Ended here, not left to turn "lost": other workers would wait for it to be reaped.
        held = liveness.end_dead(storage.db, self.study, host=registry.this_host(), pid=child.process.pid)
        if child.trial is not None:
            trial_id = child.trial[0]
        elif held is not None:  # it died after recording its trial in the registry, before telling us
            trial_id = retry.trial_id(storage, self.study, held)
        else:
            return
        retries = self.spec.search.max_retries
        study = optuna.load_study(study_name=self.study, storage=storage.optuna)
        folder = TrialDir(self.output_dir / self.study, storage.optuna.get_trial(trial_id).number)
        outcome.finish(storage, study, trial_id, ended, max_retries=retries, folder=folder, detail=how)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping += 1
        self.stop_signal = signum
        if self.stopping == 1:
            log.warning("stopping: workers checkpoint and hand their trials back (again to quit at once)")
            for child in self.children.values():
                if child.process.is_alive() and signum == signal.SIGTERM:
                    # Ctrl-C reaches the whole process group already; SIGTERM maybe only us.
                    os.kill(child.process.pid, stop_signals.STOP_REQUEST)
        else:
            for child in self.children.values():
                if child.process.is_alive():
                    child.process.kill()
