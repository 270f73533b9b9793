"""A trial over two devices: real processes, torch.distributed's gloo backend on CPU, real training."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import torch

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer import distributed
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.distributed import World
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import Run, fit
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from tests.conftest import hpsearch, lm_spec_text
from tests.support.tiny import build_tiny_gpt2, files_in

CPU = torch.device("cpu")
# 192 examples, global batch 16 = micro-batch 4 x 2 ranks x 2 accumulation steps.
CFG = TrainConfig(
    learning_rate=3e-3, batch_size=16, micro_batch_size=4, max_steps=5, eval_every=5, precision="fp32", seed=3
)


def _fit(model_dir: str, train: str, dev: str, out: Path, world: World) -> dict[str, torch.Tensor]:
    tokenizer = load_tokenizer(model_dir)
    data = prepare(DataConfig(train=train, validation=dev), tokenizer, 48, None, task="causal-lm")
    model = PretrainedCache().fresh_causal_lm(model_dir)
    run = Run(
        model=model,
        tokenizer=tokenizer,
        data=data,
        cfg=CFG,
        metric="loss",
        device=CPU,
        files=files_in(out),
        world=world,
    )
    result = fit(run, NullReporter())
    assert result.status == "complete" and result.steps == 5
    return {k: v.clone() for k, v in model.state_dict().items()}


def _rank(rank: int, port: int, model_dir: str, train: str, dev: str, out: str) -> None:
    world = distributed.join(rank, 2, port, CPU)
    try:
        torch.save(_fit(model_dir, train, dev, Path(out) / f"rank{rank}", world), Path(out) / f"rank{rank}.pt")
    finally:
        world.close()
    distributed.end_process(0)  # as a product rank ends (see end_process)


def test_two_ranks_train_what_one_device_trains(tmp_path: Path, lm_files: tuple[Path, Path]) -> None:
    """batch_size is the global batch: 2 ranks x half the micro-batches give one device's update."""
    model_dir = str(build_tiny_gpt2(tmp_path / "m", dropout=0.0))  # dropout would differ between runs
    train, dev = map(str, lm_files)
    store = distributed.main_store(2)  # the rendezvous, held by the test; both ranks connect to it
    ctx = torch.multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=_rank, args=(r, store.port, model_dir, train, dev, str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    single = _fit(model_dir, train, dev, tmp_path / "single", World())
    initial = PretrainedCache().fresh_causal_lm(model_dir).state_dict()
    moved = 0
    for name, value in single.items():
        assert torch.equal(rank0[name], rank1[name]), f"ranks differ in {name}"
        # Same data, same update; only the order of float additions differs.
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-5, msg=name)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10, "training must change the parameters"


def test_two_device_trial_from_the_cli_one_trial_same_parameters_pruned_together(
    tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "dp.toml"
    # Trial 0 (a good lr) completes; trial 1 (lr 1e-5 barely moves) is worse than it at the
    # first validation point, and the median pruner (1 start-up trial) prunes it there.
    spec.write_text(
        lm_spec_text(
            tiny_gpt2,
            *lm_files,
            extra_train="devices_per_trial = 2",
            search="pruner_startup_trials = 1\n[[search.enqueue]]\nlearning_rate = 3e-3\n"
            "[[search.enqueue]]\nlearning_rate = 1e-4",
        ).replace("n_trials = 1", "n_trials = 2")
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch(
        *("start", "--study", "dp", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:2", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
        timeout=300,
    )
    # Exit 0: the supervisor waited for rank 0, and rank 0 for its peer, which both ended.
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="dp", storage=url).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED]
    assert [t.params["learning_rate"] for t in trials] == [3e-3, 1e-4], "one study trial per trial, no duplicates"
    done, pruned = trials
    # 192 examples / 16 = 12 steps; validation at 4, 8, 12. The pruned trial stopped at 4.
    assert sorted(done.intermediate_values) == [4, 8, 12] and sorted(pruned.intermediate_values) == [4]
    for t in trials:
        assert t.user_attrs["devices"] == 2 and t.user_attrs["device"] == "cpu:0+1"
        digests = t.user_attrs["rank_parameter_digests"]
        assert len(digests) == 2 and digests[0] == digests[1], digests
        # Both ranks' examples count: 12 steps x 16 examples (the pruned trial: 4 x 16).
        assert t.user_attrs["train_samples"] == 16 * max(t.intermediate_values)
    assert done.user_attrs["rank_parameter_digests"] != pruned.user_attrs["rank_parameter_digests"]
    # Rank 1 ran each trial too (the equal digests above); the trial logs once, from rank 0.
    assert "/rank1] INFO" not in result.stderr, result.stderr[-3000:]
    best = json.loads(hpsearch("best", "--study", "dp", "--storage", url, "--json", cwd=tmp_path).stdout)
    assert Path(best["best_checkpoint"], "model.safetensors").exists()
    for n in (0, 1):  # one curve per trial, written by rank 0
        assert len(list((tmp_path / "runs" / "dp" / f"trial-{n}" / "tensorboard").glob("events.*"))) == 1


def test_a_rank_ends_with_its_code_and_what_it_wrote_but_not_yet_flushed() -> None:
    # end_process skips the interpreter's shutdown (where a gloo thread can abort the process): what the rank
    # printed without a newline and logged must still reach its streams, and its exit code its parent.
    import os
    import subprocess
    import sys

    code = (
        "import logging, sys\n"
        "from hpsearch.trainer import distributed\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
        "logging.getLogger('rank').info('trial 3 ended on rank 1')\n"
        "sys.stdout.write('unterminated')\n"
        "distributed.end_process(3)\n"
        "print('never')\n"
    )
    # A pipe, not a terminal: stdout is block-buffered, so an exit without a flush would lose the text.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unterminated" and "trial 3 ended on rank 1" in done.stderr, (done.stdout, done.stderr)
