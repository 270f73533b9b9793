"""Failures inside a trial: a full disk fails that trial with a reason and the worker goes on."""

from __future__ import annotations

import errno
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search import study as studies
from hpsearch.search.spec import load_file
from hpsearch.search.worker import StopFlag, Worker, WorkerArgs
from hpsearch.storage.open import open_storage
from hpsearch.trainer import checkpoint


def test_full_disk_fails_one_trial_and_worker_carries_on(
    tmp_path: Path, spec_file: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = load_file(spec_file)
    spec.search.n_trials = 2
    spec.train.resume_every_minutes = 0  # write resumable state at every validation point
    storage = open_storage(sqlite_url, create=True)
    studies.create_or_resume(storage, "disk", spec)

    real_save = checkpoint.torch.save
    calls = {"n": 0}

    def full_disk_once(obj, f, *a, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:  # the first resumable checkpoint of the first trial
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk_once)
    args = WorkerArgs(
        study="disk", storage_url=sqlite_url, device="cpu", name="test/cpu:0/1", output_dir=str(tmp_path / "runs")
    )
    Worker(args, storage, StopFlag(), None).run()
    storage.close()

    trials = optuna.load_study(study_name="disk", storage=sqlite_url).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert trials[0].user_attrs["fail_reason"] == "disk_full"
    assert not list((tmp_path / "runs" / "disk" / "trial-0").glob(".*tmp-*")), "no half-written checkpoint left"


def test_out_of_memory_at_micro_batch_one_fails_that_trial_and_worker_carries_on(
    tmp_path: Path, spec_file: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from hpsearch.trainer import loop

    spec = load_file(spec_file)
    spec.search.n_trials = 2
    storage = open_storage(sqlite_url, create=True)
    studies.create_or_resume(storage, "oom", spec)
    real_collate = loop.collate
    first_trial = {"done": False}

    def collate(data, indices, pad_id):  # type: ignore[no-untyped-def]
        # The first trial runs out of memory at every micro-batch size; the second has room
        # once its micro-batch is halved to 4.
        if not first_trial["done"] or len(indices) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_collate(data, indices, pad_id)

    real_fit = loop.fit

    def fit(run, reporter):  # type: ignore[no-untyped-def]
        try:
            return real_fit(run, reporter)
        finally:
            first_trial["done"] = True

    monkeypatch.setattr(loop, "collate", collate)
    monkeypatch.setattr(loop, "fit", fit)
    args = WorkerArgs(
        study="oom", storage_url=sqlite_url, device="cpu", name="test/cpu:0/1", output_dir=str(tmp_path / "runs")
    )
    Worker(args, storage, StopFlag(), None).run()
    storage.close()

    trials = optuna.load_study(study_name="oom", storage=sqlite_url).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert trials[0].user_attrs["fail_reason"] == "oom"
    assert trials[1].user_attrs["micro_batch_size"] == 4
    assert trials[1].user_attrs["accumulation_steps"] * 4 == spec.train.batch_size
