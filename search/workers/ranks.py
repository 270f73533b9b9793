"""The other ranks of a trial that spans several devices (train.devices_per_trial > 1; docs/multi-gpu.md).

The worker process of a device group is rank 0, the only one that talks to the study. It spawns a peer
process per other device (ranks 1..N-1), which keep their tokenizer, data and model between trials; for
every trial it sends each a ``TrialJob`` (the inputs of its own fit()) and they run fit() together.
Every way a rank can end reaches the supervisor as the end of rank 0: a peer dies (rank 0's watchdog kills
the others and exits with ``ExitCode.PEER_DIED``); rank 0 dies (each peer sees its parent gone and exits);
a trial fails on rank 0 (the collectives are out of step: it records the failure and exits with
``ExitCode.GROUP_RESTART``, and the group starts afresh); a rank runs out of memory (it records its micro-batch in the
trial's folder and ends, rank 0 with ``ExitCode.OUT_OF_MEMORY``: the trial is retried, every rank starting smaller)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpsearch.search.cli import main as cli
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.workers.devices import only_gpu, torch_device
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer.config import AdapterConfig, DataConfig, ModelConfig, TrainConfig

if TYPE_CHECKING:
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.points import EarlyPoints

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 30.0


class GroupRestart(Exception):
    """A trial failed on a multi-device group; its ranks must be started afresh (the worker exits with ``code``)."""

    def __init__(self, message: str, code: ExitCode = ExitCode.GROUP_RESTART) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TrialJob:
    trial: int
    model: ModelConfig
    data: DataConfig
    cfg: TrainConfig
    metric: str
    files: RunFiles
    resume_from: str | None
    adapter: AdapterConfig | None = None  # a LoRA trial (sharded: every rank holds part of the frozen base)
    early: EarlyPoints | None = None  # the pruner's early points: every rank validates there


@dataclass(frozen=True)
class PeerArgs:
    rank: int
    size: int
    port: int
    device: str  # "cpu" or "cuda" (CUDA_VISIBLE_DEVICES is narrowed to this rank's GPU)
    name: str
    output_dir: str
    threads: int | None
    log_level: int


class Peers:
    """Rank 0's side: spawns ranks 1..N-1, sends them trials, and watches them."""

    def __init__(self, kind: str, ids: tuple[str, ...], name: str, output_dir: str, threads: int | None) -> None:
        self.kind, self.ids, self.name, self.output_dir, self.threads = kind, ids, name, output_dir, threads
        self.size = 1 + len(ids)
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.closing = False

    def start(self, device: Any) -> Any:
        """Spawn the peers and join the process group with them; returns rank 0's World."""
        from hpsearch.trainer import distributed

        store = distributed.main_store(self.size)  # a free port, bound before the peers look for it
        ctx = mp.get_context("spawn")
        for rank, device_id in enumerate(self.ids, start=1):
            reader, writer = ctx.Pipe(duplex=False)
            args = PeerArgs(
                rank=rank,
                size=self.size,
                port=store.port,
                device=self.kind,
                name=f"{self.name}/rank{rank}",
                output_dir=self.output_dir,
                threads=self.threads,
                log_level=logging.getLogger().level,
            )
            process = ctx.Process(target=peer_main, args=(args, reader), name=f"hpsearch-rank{rank}")
            # Like the supervisor for rank 0: the peer's torch must see only its own GPU.
            with only_gpu(device_id if self.kind == "cuda" else None):
                process.start()
            reader.close()
            self.processes.append(process)
            self.conns.append(writer)
        threading.Thread(target=self._watch, name="hpsearch-peer-watch", daemon=True).start()
        log.info("started %d peer ranks (pids %s)", len(self.processes), [p.pid for p in self.processes])
        return distributed.join(0, self.size, store.port, device, store=store)

    def run(self, job: TrialJob) -> None:
        for conn in self.conns:
            conn.send(job)

    def close(self, *, kill: bool = False) -> None:
        self.closing = True
        for conn, process in zip(self.conns, self.processes, strict=True):
            if kill:
                process.kill()
                continue
            with contextlib.suppress(OSError):  # a peer that already died has closed its end
                conn.send(None)
        for process in self.processes:
            process.join(CLOSE_TIMEOUT_S)
            if process.is_alive():
                log.warning("peer rank %s did not exit in %gs; killing it", process.name, CLOSE_TIMEOUT_S)
                process.kill()
                process.join()

    def one_died(self, timeout: float) -> bool:
        """Whether a peer ended (or ends within ``timeout``): then ``_watch`` is ending this process, and a collective
        that failed here failed because of it."""
        return bool(wait([p.sentinel for p in self.processes], timeout))

    def _watch(self) -> None:
        # Returns as soon as any peer ends; outside close() that is always a death.
        ended = wait([p.sentinel for p in self.processes])
        if self.closing:
            return
        exit_code = ExitCode.PEER_DIED
        for rank, process in enumerate(self.processes, start=1):
            if process.sentinel in ended:
                process.join(5.0)  # the sentinel closes a moment before the exit status exists
                code = process.exitcode
                if code == ExitCode.OUT_OF_MEMORY:  # it recorded its micro-batch: the group restarts smaller
                    log.warning("peer rank %d ran out of memory: restarting the device group", rank)
                    exit_code = ExitCode.OUT_OF_MEMORY
                    continue
                how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
                log.error("peer rank %d (pid %d) died (%s): ending the device group", rank, process.pid, how)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        # os._exit: the main thread may be blocked in a collective that will never complete.
        os._exit(exit_code)


def peer_main(args: PeerArgs, conn: Connection) -> None:
    """Entry point of a spawned peer rank: train whatever rank 0 sends, until it says stop."""
    # A trial's log is rank 0's: a peer says only what went wrong (warnings, errors), unless debugging, so the
    # worker's log does not repeat every line once a rank.
    cli.setup_logging(
        args.log_level if args.log_level <= logging.DEBUG else max(args.log_level, logging.WARNING), args.name
    )
    # Rank 0 decides when to stop and broadcasts it; a terminal's Ctrl-C reaches every process: ignored here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def exit_with_parent() -> None:  # a peer blocked in a collective would otherwise wait for rank 0 forever
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_parent, name="hpsearch-parent-watch", daemon=True).start()
    import torch

    from hpsearch.trainer import distributed, meta_model
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.errors import RankOutOfMemory
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache, load_tokenizer
    from hpsearch.trainer.points import EarlyPoints, PointRows

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch_device(args.device)
    world = distributed.join(args.rank, args.size, args.port, device)
    models = PretrainedCache()
    loaded: str | None = None  # the model whose tokenizer and data are loaded
    while True:
        try:
            job: TrialJob | None = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if job is None:
            break
        if loaded != job.model.name:
            loaded, tokenizer = job.model.name, load_tokenizer(job.model.name)
            cache = Path(args.output_dir) / "token-cache"  # rank 0 tokenised already: a cache hit
            data = prepare(job.data, tokenizer, job.model.max_length, cache, task=job.model.task)
        if job.cfg.sharding == "fsdp":
            # Built empty: its shards come from rank 0's model, so this host holds the model once, not N times.
            model = meta_model.empty_model(job.model.name, data.labels, job.adapter)
        else:
            model = models.trial_model(
                job.model.name, data.labels, job.cfg.seed, job.adapter, precision=job.cfg.precision
            )
        run = Run(
            model=model,
            tokenizer=tokenizer,
            data=data,
            cfg=job.cfg,
            metric=job.metric,
            device=device,
            files=job.files,
            resume_from=Path(job.resume_from) if job.resume_from else None,
            world=world,
            early=job.early or EarlyPoints(),
            point_rows=PointRows.of(job.data),
        )
        try:
            result = fit(run, NullReporter())
            if job.cfg.sharding == "none":
                models.release(run.model)
        except RankOutOfMemory as exc:
            # Recorded by fit(); rank 0 waits in a collective this rank will never enter: its watchdog reads the code.
            log.warning("trial %d: %s; ending this rank for the group to restart smaller", job.trial, exc)
            os._exit(ExitCode.OUT_OF_MEMORY)
        except Exception:
            # A collective fails at once when rank 0 dies: give that death (the news) a moment to show, not this error.
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)
            raise
        log.info("trial %d ended on rank %d: %s at step %d", job.trial, args.rank, result.status, result.steps)
    world.close()
    distributed.end_process(0)
