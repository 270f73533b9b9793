"""A pytest plugin that records each test's CPU seconds: its own process's and those of the processes it started and
waited for (``hpsearch start`` and its workers). Wall time on a shared machine is the load's; CPU time says what a
test costs wherever it runs, and over two cores what the suite takes on a quiet 2-core machine.

    pytest -p tests.support.cpu_times            # writes cpu-times.jsonl (HPSEARCH_CPU_TIMES=path for another)
    python -m tests.support.cpu_times cpu-times.jsonl   # the total and the costliest tests and modules
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

OUT = "HPSEARCH_CPU_TIMES"


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, kids = _cpu()
    start = time.perf_counter()
    yield
    own_after, kids_after = _cpu()
    row = {
        "test": item.nodeid,
        "own": round(own_after - own, 2),
        "children": round(kids_after - kids, 2),
        "wall": round(time.perf_counter() - start, 2),
    }
    with open(os.environ.get(OUT, "cpu-times.jsonl"), "a") as out:  # one line a write: xdist workers append safely
        out.write(json.dumps(row) + "\n")


def report(path: Path, top: int = 15) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cost = {r["test"]: r["own"] + r["children"] for r in rows}
    modules: dict[str, float] = defaultdict(float)
    for test, seconds in cost.items():
        modules[test.split("::")[0]] += seconds
    total = sum(cost.values())
    lines = [f"{len(rows)} tests, {total:,.0f} CPU-s (about {total / 2 / 60:.1f} min on two busy cores)"]
    lines += [f"{s:8.1f}  {t}" for t, s in sorted(cost.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("by module:")
    lines += [f"{s:8.1f}  {m}" for m, s in sorted(modules.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else "cpu-times.jsonl")))
