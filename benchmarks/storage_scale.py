"""Many workers, one PostgreSQL study: hpsearch's storage path against plain Optuna.

For 8, 32 and 64 concurrent worker processes this runs the same workload twice against one
PostgreSQL server with default settings (max_connections = 100):

* ``optuna``: each process calls ``study.optimize`` on ``RDBStorage(url)``, Optuna's defaults;
* ``hpsearch``: each process runs a worker's loop through hpsearch's own code: ``open_storage``
  (one engine, pre-ping, keepalives, retries), the exact budget (``slots.claim_slot``), the
  worker registry with its heartbeat thread, and the sampler/pruner a study spec asks for.

Both use the same TPE sampler (constant liar) and median pruner and a fast synthetic
objective (no torch) that reports 10 intermediate values per trial, so what differs is only
the storage path. Printed per row: trials/s, errors, lost or duplicated trials, peak
connections seen in ``pg_stat_activity`` (sampled every 20 ms) and connections per worker
process. Targets (issue 8): zero errors, zero lost or duplicated trials, peak connections
<= 1.25 x processes, throughput within 1.2x of plain Optuna where plain Optuna runs.

By default the script starts a throwaway PostgreSQL 15 cluster (initdb + pg_ctl, default
settings, its own port) and removes it afterwards; it never touches a running server. Run as
root it needs an unprivileged OS user for PostgreSQL (``useradd -m pgbench``).

    python benchmarks/storage_scale.py                       # 8, 32, 64 workers
    python benchmarks/storage_scale.py --workers 64 --trials-per-worker 2
    python benchmarks/storage_scale.py --url postgresql://hp:pw@host:5432/bench   # your server
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import multiprocessing as mp
import os
import pwd
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
import psycopg2
from optuna.trial import TrialState
from sqlalchemy import func, select

from hpsearch.search import presets
from hpsearch.search.study import budget, sampling, spec as specs, studies
from hpsearch.search.workers.trial_attrs import TrialReporter
from hpsearch.storage import registry, slots
from hpsearch.storage.open import open_storage
from hpsearch.storage.tables import TrialSlot

log = logging.getLogger("storage_scale")
STEPS = 10
BENCH_PASSWORD = "bench-" + uuid.uuid4().hex[:8]


# -- a throwaway PostgreSQL cluster ----------------------------------------------------------


@dataclass
class Cluster:
    url: str
    """What workers use: TCP, a non-superuser with a password, like a real deployment."""
    admin_dsn: str
    """Superuser over the Unix socket, for setup and for watching pg_stat_activity."""
    database: str


@contextlib.contextmanager
def throwaway_cluster(port: int, os_user: str | None) -> Iterator[Cluster]:
    bindir = _pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="hpsearch-bench-pg-"))
    data, sock = root / "data", root
    as_user: list[str] = []
    if os.geteuid() == 0:
        # initdb refuses to run as root: run the cluster as an unprivileged user.
        name = os_user or "pgbench"
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise SystemExit(
                f"running as root: PostgreSQL needs an unprivileged OS user; create one "
                f"(useradd -m {name}) or pass --pg-os-user NAME"
            ) from None
        os.chown(root, entry.pw_uid, entry.pw_gid)
        as_user = ["runuser", "-u", name, "--"]
    env = {**os.environ, "LC_ALL": "C"}
    try:
        subprocess.run(
            [
                *as_user,
                f"{bindir}/initdb",
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        # Only where it listens changes; max_connections and the rest stay at initdb's defaults.
        opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [
                *as_user,
                f"{bindir}/pg_ctl",
                "-D",
                str(data),
                "-o",
                opts,
                "-l",
                str(root / "server.log"),
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        admin_dsn = f"host={sock} port={port} user=postgres dbname=postgres"
        conn = psycopg2.connect(admin_dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE ROLE hp LOGIN PASSWORD '{BENCH_PASSWORD}'")
            cur.execute("CREATE DATABASE bench OWNER hp")
        conn.close()
        # The explicit driver: plain optuna gets the URL as is, and SQLAlchemy 2.1 would pick
        # psycopg 3 for a bare postgresql://.
        url = f"postgresql+psycopg2://hp:{BENCH_PASSWORD}@127.0.0.1:{port}/bench"
        yield Cluster(url, admin_dsn, "bench")
    finally:
        subprocess.run(
            [*as_user, f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            env=env,
        )
        shutil.rmtree(root, ignore_errors=True)


def _pg_bindir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return str(Path(found[-1]).parent)
    initdb = shutil.which("initdb")
    if initdb is None:
        raise SystemExit("initdb not found: install PostgreSQL, or pass --url of a server to use")
    return str(Path(initdb).parent)


# -- the two workloads -----------------------------------------------------------------------


def objective_values(params: dict[str, Any], number: int) -> list[float]:
    """A fast synthetic learning curve: best near lr = 3e-4, improving over 10 validations."""
    import math

    base = (math.log10(params["learning_rate"]) + 3.5) ** 2 + params.get("weight_decay", 0.0)
    return [base + 1.0 / (step + 1) + 0.01 * ((number * 7 + step) % 5) for step in range(STEPS)]


def run_trial(
    trial: optuna.Trial, spec: specs.StudySpec, storage: optuna.storages.BaseStorage
) -> tuple[TrialState, float | None]:
    params = sampling.suggest(trial, spec)
    reporter = TrialReporter(trial, storage)
    best = None
    for step, value in enumerate(objective_values(params, trial.number), start=1):
        # The worker's order at a validation point: report, then ask the pruner.
        reporter.report(value, step)
        best = value if best is None else min(best, value)
        if reporter.should_prune():
            return TrialState.PRUNED, None
    return TrialState.COMPLETE, best


class _Counter(logging.Handler):
    """Counts the storage layer's retried transient errors (logged as warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.retries = 0
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.retries += 1
        self.messages.append(record.getMessage()[:200])


def hpsearch_worker(url: str, study: str, index: int, go: Any, results: Any, heartbeat_s: float) -> None:
    """One worker process, step for step as search/workers/worker.py runs it, with a synthetic objective."""
    counter = _Counter()
    logging.getLogger("hpsearch").addHandler(counter)
    out: dict[str, Any] = {"index": index, "finished": 0, "errors": [], "beats": 0}
    go.wait()
    try:
        storage = open_storage(url, create=False)
        try:
            spec = presets.resolved(studies.stored_spec(storage, study))
            name = f"bench-host-{index // 8}/cpu:{index % 8}/{os.getpid()}"
            study_obj = optuna.load_study(
                study_name=study,
                storage=storage.optuna,
                sampler=sampling.make_sampler(spec, sampling.worker_seed(spec, name)),
                pruner=sampling.make_pruner(spec),
            )
            with registry.Registration(storage.db, study, name, f"cpu:{index % 8}", interval_s=heartbeat_s) as reg:
                while True:
                    n_trials = budget.n_trials(study_obj, spec)
                    slot = slots.claim_slot(storage.db, study, n_trials, name)
                    if slot is None:
                        break
                    trial = study_obj.ask()
                    slots.bind_slot(storage.db, study, slot, trial.number)
                    reg.trial_started(trial.number)
                    state, value = run_trial(trial, spec, storage.optuna)
                    if state == TrialState.COMPLETE:
                        study_obj.tell(trial, value)
                    else:
                        study_obj.tell(trial, state=state)
                    reg.trial_ended()
                    out["finished"] += 1
            out["beats"] = reg.beats
        finally:
            storage.close()
    except Exception as exc:  # counted and reported, never hidden
        out["errors"].append(_describe(exc))
    out["retries"], out["retry_messages"] = counter.retries, counter.messages[:3]
    results.put(out)


def optuna_worker(
    url: str, study: str, index: int, go: Any, results: Any, spec: specs.StudySpec, per_worker: int
) -> None:
    """Plain Optuna as its documentation shows it: a URL, ``study.optimize``, same sampler."""
    out: dict[str, Any] = {"index": index, "finished": 0, "errors": [], "beats": 0, "retries": 0}
    go.wait()
    try:
        name = f"plain-{index}"
        plain = optuna.storages.RDBStorage(url)
        study_obj = optuna.load_study(
            study_name=study,
            storage=plain,
            sampler=sampling.make_sampler(spec, sampling.worker_seed(spec, name)),
            pruner=sampling.make_pruner(spec),
        )

        def objective(trial: optuna.Trial) -> float:
            state, value = run_trial(trial, spec, plain)
            if state == TrialState.PRUNED:
                raise optuna.TrialPruned()
            assert value is not None
            return value

        for _ in range(per_worker):
            try:
                study_obj.optimize(objective, n_trials=1)
                out["finished"] += 1
            except Exception as exc:
                out["errors"].append(_describe(exc))
    except Exception as exc:
        out["errors"].append(_describe(exc))
    results.put(out)


def _describe(exc: BaseException) -> str:
    """The error and, when Optuna wrapped a driver error, the driver's first line too."""
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__
    if cause is not None and str(cause):
        text += f" <- {type(cause).__name__}: {str(cause).strip().splitlines()[-1][:160]}"
    return text


# -- measuring -------------------------------------------------------------------------------


class ConnectionWatcher:
    """Samples pg_stat_activity for the benchmark database every 20 ms; keeps the peak."""

    def __init__(self, dsn: str, database: str) -> None:
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        self.database = database
        self.peak = 0
        self.peak_at = 0.0
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ConnectionWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.conn.close()

    def _loop(self) -> None:
        with self.conn.cursor() as cur:
            while not self._stop.wait(0.02):
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                    (self.database,),
                )
                count = cur.fetchone()[0]
                if count > self.peak:
                    self.peak, self.peak_at = count, time.perf_counter() - self.start


@dataclass
class Row:
    storage: str
    workers: int
    expected: int
    seconds: float = 0.0
    finished: int = 0
    lost: int = 0
    duplicated: int = 0
    errors: list[str] = field(default_factory=list)
    retries: int = 0
    peak: int = 0
    peak_at: float = 0.0
    """Seconds after the start when the peak was first seen (start-up or steady state?)."""
    beats: int = 0

    @property
    def rate(self) -> float:
        return self.finished / self.seconds if self.seconds else 0.0


def run_row(
    kind: str,
    n: int,
    per_worker: int,
    url: str,
    cluster: Cluster,
    spec: specs.StudySpec,
    heartbeat_s: float,
) -> Row:
    study = f"{kind}-{n}-{uuid.uuid4().hex[:6]}"
    spec = replace(spec, search=replace(spec.search, n_trials=n * per_worker))
    if kind == "hpsearch":
        storage = open_storage(url, create=True)
        studies.create_or_resume(storage, study, spec)
        storage.close()
    else:
        plain = optuna.storages.RDBStorage(url)
        optuna.create_study(study_name=study, storage=plain, direction=spec.direction)
        plain.engine.dispose()
    # fork, not spawn: no CUDA here, and 64 interpreters re-importing optuna on 2 cores would
    # measure import time, not storage. Every engine is created in the child, after the fork.
    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    if kind == "hpsearch":
        procs = [ctx.Process(target=hpsearch_worker, args=(url, study, i, go, results, heartbeat_s)) for i in range(n)]
    else:
        procs = [
            ctx.Process(target=optuna_worker, args=(url, study, i, go, results, spec, per_worker)) for i in range(n)
        ]
    for p in procs:
        p.start()
    row = Row(kind, n, n * per_worker)
    with ConnectionWatcher(cluster.admin_dsn, cluster.database) as watcher:
        start = watcher.start = time.perf_counter()
        go.set()
        reports = []
        for _ in procs:
            try:
                reports.append(results.get(timeout=900))
            except queue.Empty:
                break
        for p in procs:
            p.join(timeout=60)
        row.seconds = time.perf_counter() - start
        row.peak, row.peak_at = watcher.peak, watcher.peak_at
    for p in procs:
        if p.exitcode != 0:
            row.errors.append(f"worker process exit code {p.exitcode}")
    for r in reports:
        row.errors += r["errors"]
        row.retries += r.get("retries", 0)
        row.beats += r.get("beats", 0)
    _count_trials(row, url, study)
    return row


def _count_trials(row: Row, url: str, study: str) -> None:
    storage = open_storage(url, create=False)
    try:
        trials = optuna.load_study(study_name=study, storage=storage.optuna).get_trials(deepcopy=False)
        done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        row.finished = len(done)
        row.lost = max(0, row.expected - len(done))
        row.duplicated = max(0, len(done) - row.expected)
        if row.storage == "hpsearch":
            # Every trial slot is bound to its own trial: a slot run twice would show here.
            bound = storage.db.run(
                lambda s: s.execute(
                    select(func.count(TrialSlot.trial_number.distinct())).where(TrialSlot.study_name == study)
                ).scalar_one(),
                what="count bound slots",
            )
            row.duplicated += max(0, len(trials) - bound)
    finally:
        storage.close()


# -- report ----------------------------------------------------------------------------------


def print_rows(rows: list[Row]) -> None:
    print(
        f"{'workers':>7} {'storage':<9} {'trials':>7} {'s':>7} {'trials/s':>9} {'errors':>6} "
        f"{'retries':>7} {'lost':>5} {'dup':>4} {'peak conn':>9} {'conn/proc':>9} {'at s':>6} {'beats':>6}"
    )
    for r in rows:
        print(
            f"{r.workers:>7} {r.storage:<9} {r.finished:>4}/{r.expected:<3}{r.seconds:>6.1f} {r.rate:>9.2f} "
            f"{len(r.errors):>6} {r.retries:>7} {r.lost:>5} {r.duplicated:>4} {r.peak:>9} "
            f"{r.peak / r.workers:>9.2f} {r.peak_at:>6.1f} {r.beats:>6}"
        )


def verdict(rows: list[Row]) -> bool:
    ok = True
    by = {(r.storage, r.workers): r for r in rows}
    for n in sorted({r.workers for r in rows}):
        ours, plain = by.get(("hpsearch", n)), by.get(("optuna", n))
        if plain is not None:
            if plain.errors:
                first = next((e for e in plain.errors if "too many clients" in e), plain.errors[0])
                print(f"{n:>3} workers: plain optuna FAILED ({len(plain.errors)} errors, e.g. {first})")
            else:
                print(f"{n:>3} workers: plain optuna ran ({plain.rate:.2f} trials/s, peak {plain.peak} connections)")
        if ours is None:
            continue
        checks = {
            "no errors": not ours.errors,
            "no lost or duplicated trials": ours.lost == 0 and ours.duplicated == 0,
            f"peak connections {ours.peak} <= 1.25 x {n}": ours.peak <= 1.25 * n,
        }
        if plain is not None and not plain.errors and plain.rate > 0:
            ratio = plain.rate / ours.rate if ours.rate else float("inf")
            checks[f"throughput: plain/hpsearch = {ratio:.2f} <= 1.2"] = ratio <= 1.2
        for name, passed in checks.items():
            print(f"{n:>3} workers: hpsearch {'ok  ' if passed else 'FAIL'} {name}")
            ok &= passed
        for e in ours.errors[:3]:
            print(f"      error: {e}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--trials-per-worker", type=int, default=3)
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=1.0,
        help="heartbeat interval (default 1 s: 30x the production default, to stress it)",
    )
    parser.add_argument("--port", type=int, default=55432, help="port of the throwaway cluster")
    parser.add_argument("--pg-os-user", help="unprivileged OS user to run the throwaway cluster (as root)")
    parser.add_argument("--skip-optuna", action="store_true", help="only the hpsearch rows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    preset = presets.preset_file("bert-lr")
    assert preset is not None
    spec = specs.load_file(preset)
    with throwaway_cluster(args.port, args.pg_os_user) as cluster:
        conn = psycopg2.connect(cluster.admin_dsn)
        with conn.cursor() as cur:
            cur.execute("SHOW max_connections")
            max_conn = cur.fetchone()[0]
            cur.execute("SHOW server_version")
            version = cur.fetchone()[0]
        conn.close()
        print(
            f"PostgreSQL {version}, max_connections = {max_conn} (defaults); {os.cpu_count()} CPUs; "
            f"{args.trials_per_worker} trials per worker, {STEPS} reports per trial, "
            f"heartbeat every {args.heartbeat_s:g} s"
        )
        rows: list[Row] = []
        for n in args.workers:
            kinds = ["hpsearch"] if args.skip_optuna else ["optuna", "hpsearch"]
            for kind in kinds:
                row = run_row(kind, n, args.trials_per_worker, cluster.url, cluster, spec, args.heartbeat_s)
                rows.append(row)
                print_rows([row])
    print()
    print_rows(rows)
    print()
    return 0 if verdict(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
