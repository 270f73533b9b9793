"""A CPU worker started right after another job: does it train on every core the machine has idle now (issue 60)?

    python benchmarks/idle_threads.py              # 60 s of busy cores, then one bert-lr trial
    python benchmarks/idle_threads.py --busy-seconds 90 --busy-while-starting 1

First every core is kept busy for ``--busy-seconds`` (the 1-minute load average then says "busy"), then the busy
jobs stop, except ``--busy-while-starting`` of them, which keep running through the trial; at once a real
`hpsearch start --study bert-lr --n-trials 1` (one CPU worker) runs on a throwaway SQLite storage. Printed: the load
average when the trial started, the cores the machine has, the cores left busy, and the threads the trial
trained with (its ``torch_threads`` attribute). Expected: every core on an idle machine, whatever the load average
still remembers; one fewer for each core another job holds. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy-seconds", type=float, default=60.0)
    p.add_argument("--busy-while-starting", type=int, default=0, help="cores kept busy through the trial")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    now = time.monotonic()
    spinners = [mp.Process(target=_spin, args=(now + args.busy_seconds,)) for _ in range(cores)]
    keepers = [mp.Process(target=_spin, args=(now + 10 * 3600,)) for _ in range(args.busy_while_starting)]
    for proc in [*spinners, *keepers]:
        proc.start()
    for proc in spinners:
        proc.join()
    load = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="idle-threads-") as tmp:
            db = Path(tmp) / "idle.db"
            started = time.monotonic()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "hpsearch.search.cli.main",
                    "start",
                    "--study",
                    "bert-lr",
                    "--n-trials",
                    "1",
                    "--storage",
                    f"sqlite:///{db}",
                    "--output-dir",
                    str(Path(tmp) / "runs"),
                ],
                check=True,
                cwd=tmp,
                env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
                stdout=subprocess.DEVNULL,
            )
            seconds = time.monotonic() - started
            import optuna

            trial = optuna.load_study(study_name="bert-lr", storage=f"sqlite:///{db}").trials[0]
            threads = trial.user_attrs.get("torch_threads")
    finally:
        for proc in keepers:
            proc.kill()
    print(f"cores {cores}, busy for {args.busy_seconds:.0f} s before; load average at the start {load:.2f}")
    print(f"cores another job held through the trial: {args.busy_while_starting}")
    expected = max(cores - args.busy_while_starting, 1)
    print(f"the trial trained with {threads} thread(s) (expected {expected}), {seconds:.1f} s")
    return 0 if threads == expected else 1


if __name__ == "__main__":
    sys.exit(main())
