"""Sharded trials through the CLI, as a user runs them: `start` on --devices cpu:2 with sharding = "fsdp" runs a
search to the end, and a sharded trial whose rank is killed (or stopped) resumes from its sharded state."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from tests.conftest import Cli, hpsearch, lm_spec_text
from tests.support.inject import faults_env
from tests.support.tiny import build_tiny_gpt2
from tests.test_faults import _assert_recovered, _held_start, _spawned_workers

FSDP = 'devices_per_trial = 2\nsharding = "fsdp"'


def test_a_sharded_search_runs_to_the_end_and_its_best_model_loads(
    cli: Cli, tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    spec = tmp_path / "fsdp.toml"
    spec.write_text(
        lm_spec_text(tiny_gpt2, *lm_files, extra_train=FSDP, search="keep_top_k = 1")
        .replace("n_trials = 1", "n_trials = 2")
        .replace('pruner = "median"', 'pruner = "none"')
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    runs = tmp_path / "runs"
    result = hpsearch(
        *("start", "--study", "s", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:2", "--output-dir", str(runs)),
        cwd=tmp_path,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    for t in trials:
        assert t.user_attrs["sharding"] == "fsdp" and t.user_attrs["devices"] == 2
        assert len(t.user_attrs["rank_held_mb"]) == 2 and "rank_parameter_digests" not in t.user_attrs
    # The trial logs once, from rank 0; the peer only what went wrong. The held line says what it measured.
    assert "/rank1] INFO" not in result.stderr, result.stderr[-3000:]
    held = [line for line in result.stderr.splitlines() if "held at the end" in line]
    assert len(held) == 2 and all("(parameters + optimizer state): rank 0 " in h and "; rank 1 " in h for h in held)
    # Retention kept the best trial's model only; it is a plain Hugging Face folder.
    best = json.loads(cli("best", "--study", "s", "--storage", url, "--json", cwd=tmp_path).stdout)
    assert len(list(runs.glob("s/trial-*/best"))) == 1
    model = AutoModelForCausalLM.from_pretrained(best["best_checkpoint"])
    assert isinstance(next(model.parameters()), torch.nn.Parameter)
    export = tmp_path / "export"
    done = cli("best", "--study", "s", "--storage", url, "--export", str(export), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (export / "model.safetensors").exists()
    assert not list(runs.glob("s/trial-*/resume")), "a finished trial's sharded state is swept"
    # The memory plan `start` made is on the study, and status shows it.
    status = cli("status", "--study", "s", "--storage", url, cwd=tmp_path).stdout
    assert "memory plan: " in status and "fsdp over 2" in status and ": fits cpu:0+1's" in status, status


@pytest.mark.parametrize("who,sig,reason", [(1, signal.SIGKILL, "worker_crash"), (0, signal.SIGTERM, "interrupted")])
def test_a_sharded_trial_killed_or_stopped_resumes_from_its_sharded_state(
    tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path], sqlite_url: str, who: int, sig: int, reason: str
) -> None:
    spec = tmp_path / "fsdp.toml"
    # 192 examples, batch 16: 12 steps, a point every 4. The rank signalled is held at step 4 (its point's report
    # and sharded state written) until the signal comes: the trial cannot end first, however fast its steps.
    spec.write_text(
        lm_spec_text(tiny_gpt2, *lm_files, extra_train=FSDP, search="max_retries = 2").replace(
            'pruner = "median"', 'pruner = "none"'
        )
    )
    with _held_start(tmp_path, spec, sqlite_url, 4, rank=who, devices="cpu:2") as (proc, hold):
        (rank0,) = _spawned_workers(proc.pid)
        (rank1,) = _spawned_workers(rank0)
        assert hold.pid == (rank1 if who == 1 else rank0)
        state = next((tmp_path / "runs" / "f").glob("trial-*/resume"))
        # Each rank wrote its own part of the state; rank 0 the rest.
        assert sorted(p.name for p in (state / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert (state / "state.pt").is_file()
        os.kill(hold.pid, sig)
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    _assert_recovered(sqlite_url, 1, reason, tmp_path / "runs")


def test_a_sharded_lora_search_through_the_cli_saves_an_adapter_folder(
    tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]
) -> None:
    """The worker path of a LoRA trial over 2 sharded ranks: rank 0's adapter on its own copy of the base, the
    peer's built empty and filled from rank 0's."""
    from hpsearch.trainer.adapters import load_saved

    spec = tmp_path / "lora.toml"
    spec.write_text(
        lm_spec_text(tiny_gpt2, *lm_files, extra_train=FSDP) + '[adapter]\nmethod = "lora"\nr = 4\ndropout = 0.0\n'
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch(
        *("start", "--study", "l", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:2", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (trial,) = optuna.load_study(study_name="l", storage=url).trials
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["sharding"] == "fsdp"
    best = Path(trial.user_attrs["best_checkpoint"])
    assert (best / "adapter_config.json").exists() and not (best / "model.safetensors").exists()
    assert load_saved(best) is not None  # AutoPeftModelForCausalLM


class _OomStudies:
    """One tiny GPT-2, and `start` on it over 2 ranks, for the out-of-memory tests. The run that never runs out
    depends on the sharding only (not on which rank the test makes run out): it is run once per sharding and read by
    every test that compares against it."""

    def __init__(self, root: Path, lm_files: tuple[Path, Path]) -> None:
        self.root, self.lm_files = root, lm_files
        self.model = build_tiny_gpt2(root / "m", dropout=0.0)  # a micro-batch of 4 would draw other dropout masks
        self._straight: dict[str, optuna.trial.FrozenTrial] = {}

    def start(self, sharding: str, study: str, **env: str) -> list[optuna.trial.FrozenTrial]:
        spec = self.root / f"{sharding}.toml"
        train = f'devices_per_trial = 2\nsharding = "{sharding}"'
        spec.write_text(
            lm_spec_text(self.model, *self.lm_files, extra_train=train, search="max_retries = 0").replace(
                'pruner = "median"', 'pruner = "none"'
            )
        )
        url = f"sqlite:///{self.root / 'db.sqlite'}"
        args = ("start", "--study", study, "--config", str(spec), "--storage", url, "--devices", "cpu:2")
        result = hpsearch(*args, "--output-dir", str(self.root / "runs"), cwd=self.root, env=env, timeout=500)
        assert result.returncode == 0, result.stderr[-3000:]
        return optuna.load_study(study_name=study, storage=url).trials

    def straight(self, sharding: str) -> optuna.trial.FrozenTrial:
        if sharding not in self._straight:
            (self._straight[sharding],) = self.start(sharding, f"straight-{sharding}")
        return self._straight[sharding]


@pytest.fixture(scope="module")
def oom_studies(tmp_path_factory: pytest.TempPathFactory, lm_files: tuple[Path, Path]) -> _OomStudies:
    return _OomStudies(tmp_path_factory.mktemp("oom"), lm_files)


@pytest.mark.parametrize(("sharding", "rank"), [("fsdp", 1), ("none", 1), ("fsdp", 0)])
def test_one_rank_out_of_memory_restarts_the_group_at_half_the_micro_batch(
    oom_studies: _OomStudies, sharding: str, rank: int
) -> None:
    """One rank alone runs out of memory at step 6 (the other is already waiting in a collective): a peer's exit
    code reaches the supervisor through rank 0's watchdog, rank 0's own OOM through its attempt. The retry starts
    every rank at micro-batch 4 from the state of step 4: the same 12 optimizer steps of 16 examples, and the same
    losses as a run that never ran out (the normalisation is over the whole step). max_retries = 0: the restart is
    not counted, as one device's halving costs no retry."""
    # Micro-batches of 8: one each per rank and step. The rank cannot hold 8 from step 6 on.
    failed, retry = oom_studies.start(
        sharding, f"oom-{sharding}-{rank}", **faults_env(HPSEARCH_FAULT_OOM=f"{rank}:6:4")
    )
    assert failed.state == TrialState.FAIL and failed.user_attrs["fail_reason"].startswith("oom_restart")
    assert retry.state == TrialState.COMPLETE and retry.params == failed.params
    assert retry.user_attrs["retry_of"] == 0 and retry.user_attrs["retry_count"] == 0
    assert retry.user_attrs["resumed_from_step"] == 4
    # Half the micro-batch, twice the accumulation: the same 16 examples a step, the same 12 steps.
    assert retry.user_attrs["micro_batch_size"] == 4 and retry.user_attrs["accumulation_steps"] == 2
    assert sorted(retry.intermediate_values) == [8, 12]
    straight = oom_studies.straight(sharding)
    assert straight.user_attrs["micro_batch_size"] == 8 and straight.params == failed.params
    for step in (8, 12):
        assert retry.intermediate_values[step] == pytest.approx(straight.intermediate_values[step], rel=1e-4)
    runs = oom_studies.root / "runs"
    assert not list(runs.glob(f"oom-{sharding}-{rank}/trial-*/resume")), (
        "the record went with the finished trial's state"
    )
