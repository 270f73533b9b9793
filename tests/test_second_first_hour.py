"""What a new user notices after a first search on a machine without GPUs: the hours are CPU-hours, a start on a
used budget says so at once, and an exported model is readable like any file the user makes."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import hpsearch, spec_text, start_study


@dataclass
class Done:
    root: Path
    url: str
    spec: Path


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> Done:
    """A study of one trial, its budget used."""
    root = tmp_path_factory.mktemp("done")
    spec = root / "s.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1))
    url = f"sqlite:///{root / 'db.sqlite'}"
    start_study("d", spec, url, root)
    return Done(root, url, spec)


def test_status_on_a_machine_without_gpus_counts_cpu_hours(done: Done) -> None:
    shown = hpsearch("status", "--study", "d", "--storage", done.url, cwd=done.root)
    assert shown.returncode == 0, shown.stderr
    workers = next(line for line in shown.stdout.splitlines() if line.startswith("workers:"))
    assert workers.endswith(" CPU-h") and "GPU-h" not in workers, workers


def test_start_on_a_used_budget_says_so_and_starts_no_worker(done: Done) -> None:
    t0 = time.monotonic()
    again = hpsearch(
        *("start", "--study", "d", "--config", str(done.spec), "--storage", done.url),
        *("--devices", "cpu:1", "--output-dir", str(done.root / "runs")),
        cwd=done.root,
    )
    took = time.monotonic() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    said = "hpsearch start: study d: nothing to run, its budget of 1 trials is used; raise it with --n-trials"
    assert said in again.stderr, again.stderr[-3000:]
    assert "/cpu:0/" not in again.stderr, "a worker was started"
    assert "trials: 1/1 finished" in again.stdout and "best: trial 0" in again.stdout
    status = hpsearch("status", "--study", "d", "--storage", done.url, "--json", cwd=done.root)
    import json

    assert len(json.loads(status.stdout)["workers"]) == 1, "only the first start's worker registered"
    assert took < 60, took


def test_an_export_follows_the_umask_like_any_new_file(done: Done) -> None:
    """transformers writes model.safetensors 0600; the export's weights were unreadable where the rest was not."""
    target = done.root / "exported"
    old = os.umask(0o022)
    try:
        result = hpsearch("best", "--study", "d", "--storage", done.url, "--export", str(target), cwd=done.root)
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr[-2000:]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
