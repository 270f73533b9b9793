"""Causal-LM fine-tunes: prompt masking, a real trial from the CLI, its checkpoint generating text, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.storage.trialdir import RESUME, RESUME_FILE
from hpsearch.trainer.batching import collate, even_shards
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import Run, fit
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from hpsearch.trainer.report import TrainResult
from hpsearch.trainer.task_names import IGNORE_INDEX
from tests.conftest import hpsearch, lm_spec_text, one_trial
from tests.support.tiny import files_in, write_lm_split


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pairs")
    return write_lm_split(root / "train.jsonl", 96, 1, pairs=True), write_lm_split(
        root / "dev.jsonl", 48, 2, pairs=True
    )


def test_prompt_tokens_are_kept_out_of_the_loss(tiny_gpt2: Path, pair_files: tuple[Path, Path]) -> None:
    tok = load_tokenizer(str(tiny_gpt2))
    data = prepare(DataConfig(train=str(pair_files[0]), validation=str(pair_files[1])), tok, 48, None, "causal-lm")
    row = json.loads(pair_files[0].read_text().splitlines()[0])
    prompt = tok(row["prompt"])["input_ids"]
    response = tok(row["response"], add_special_tokens=False)["input_ids"]
    assert data.train.input_ids[0] == prompt + response + [tok.eos_token_id]
    batch = collate(data.train, [0, 1], data.pad_id)
    labels, mask = batch["labels"], batch["attention_mask"]
    n = len(prompt)
    assert (labels[0, :n] == IGNORE_INDEX).all(), "prompt tokens are not trained on"
    assert labels[0, n:].tolist()[: len(response) + 1] == [*response, tok.eos_token_id]
    assert (labels[mask == 0] == IGNORE_INDEX).all(), "padding is not trained on"
    # The loss averages over response tokens + EOS only.
    assert data.train.targets([0]) == len(response) + 1


def test_text_rows_train_on_every_token_but_the_first(tiny_gpt2: Path, lm_files: tuple[Path, Path]) -> None:
    tok = load_tokenizer(str(tiny_gpt2))
    data = prepare(DataConfig(train=str(lm_files[0]), validation=str(lm_files[1])), tok, 48, None, "causal-lm")
    assert data.train.prompt_lengths[0] == 0
    assert data.train.targets([0]) == len(data.train.input_ids[0]) - 1
    assert (collate(data.train, [0], data.pad_id)["labels"][0] != IGNORE_INDEX).all()


def test_even_shards_gives_every_rank_as_many_micro_batches() -> None:
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    shards = even_shards(batches, 2)
    assert len(shards) == 4 and sorted(i for b in shards for i in b) == list(range(9))
    assert even_shards(batches, 3) == batches
    with pytest.raises(ValueError, match="cannot feed 4 devices"):
        even_shards([[0], [1]], 4)


def test_causal_lm_trial_from_the_cli_learns_and_its_checkpoint_generates(
    tmp_path: Path, tiny_gpt2: Path, pair_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "lm.toml"
    # A known-good learning rate, so the test does not depend on what the sampler draws on this host.
    enqueue = "[[search.enqueue]]\nlearning_rate = 1e-2"
    spec.write_text(lm_spec_text(tiny_gpt2, *pair_files, search=enqueue).replace("eval_every = 4", "eval_every = 2"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("lm", spec, url, tmp_path)
    values = [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]
    assert sorted(trial.intermediate_values) == [2, 4, 6]  # 96 / 16 = 6 steps
    assert values[-1] < values[0] - 0.5, f"the validation loss must fall: {values}"
    assert trial.value == min(values)
    assert trial.user_attrs["best_val_perplexity"] == pytest.approx(math.exp(trial.value))
    assert "best_val_accuracy" not in trial.user_attrs

    best = json.loads(hpsearch("best", "--study", "lm", "--storage", url, "--json", cwd=tmp_path).stdout)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(best["best_checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(best["best_checkpoint"])
    prompt = tok("the movie was gripping. verdict:", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, prompt["input_ids"].shape[1] :]
    assert len(new) >= 1 and str(tok.decode(new)).strip(), "the checkpoint generates text"


def test_causal_lm_checkpoint_and_resume_with_gradient_checkpointing(
    tiny_gpt2: Path, lm_files: tuple[Path, Path], tmp_path: Path
) -> None:
    tok = load_tokenizer(str(tiny_gpt2))
    data = prepare(DataConfig(train=str(lm_files[0]), validation=str(lm_files[1])), tok, 48, None, "causal-lm")
    cfg = TrainConfig(
        learning_rate=3e-3, batch_size=16, micro_batch_size=8, max_steps=8, eval_every=4, precision="fp32"
    )

    def train(out: Path, **kw: Any) -> tuple[TrainResult, NullReporter]:
        model = PretrainedCache().fresh_causal_lm(str(tiny_gpt2))
        reporter = NullReporter()
        run = Run(
            model=model,
            tokenizer=tok,
            data=data,
            cfg=cfg,
            metric="loss",
            device=torch.device("cpu"),
            files=files_in(out),
        )
        for key, value in kw.items():
            setattr(run, key, value)
        return fit(run, reporter), reporter

    calls = {"n": 0}

    def stop_at_step_4() -> bool:
        calls["n"] += 1
        return calls["n"] >= 4

    first, _ = train(tmp_path / "a", should_stop=stop_at_step_4)
    assert first.status == "interrupted" and first.steps == 4
    resumed, rep = train(tmp_path / "b", resume_from=tmp_path / "a" / RESUME / RESUME_FILE)
    assert resumed.status == "complete" and sorted(rep.values) == [8], "it continues at step 4"
    _, rep_straight = train(tmp_path / "c")
    assert rep.values[8] == pytest.approx(rep_straight.values[8], rel=1e-4)
