"""Real chat data holds a few conversations longer than the chosen model.max_length: those rows are left out and
reported, and only a file that loses more than data.max_dropped_share of its rows (or all) is refused."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpsearch.search.presets import tiny_llama_chat
from hpsearch.trainer.chat import render
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.task_names import IGNORE_INDEX
from tests.conftest import Cli, assert_refused, lm_spec_text, start_study


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_chat.build(tmp_path_factory.mktemp("tiny-llama") / "model", pretrain_steps=0)


@pytest.fixture(scope="module")
def sst2_chat(shared_data: Path) -> list[list[dict[str, str]]]:
    """SST-2 sentences as the issue's user rendered them: "sentiment of: <sentence>" -> "negative"/"positive"."""
    with (shared_data / "sst2" / "train.tsv").open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:240]
    verdict = {"0": "negative", "1": "positive"}
    return [
        [
            {"role": "user", "content": f"sentiment of: {r['sentence']}"},
            {"role": "assistant", "content": verdict[r["label"]]},
        ]
        for r in rows
    ]


def _first_loss_token(tokenizer: Any, conversation: list[dict[str, str]]) -> int:
    _, labels = render(tokenizer, conversation, "test")
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


def _write(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def _length_dropping(firsts: list[int], share: float) -> int:
    """A max_length that leaves out about ``share`` of the rows (those whose first loss token is at or past it)."""
    return sorted(firsts, reverse=True)[max(1, round(len(firsts) * share)) - 1]


def test_a_few_long_real_rows_are_left_out_and_reported_and_the_search_trains(
    tmp_path: Path, tiny_llama: Path, sst2_chat: list[list[dict[str, str]]]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    train_rows, dev_rows = sst2_chat[:200], sst2_chat[200:]
    firsts = [_first_loss_token(tokenizer, c) for c in train_rows]
    max_length = _length_dropping(firsts, 0.03)
    assert max_length <= 256, "within the tiny Llama's positions"
    long_lines = [i + 1 for i, first in enumerate(firsts) if first >= max_length]
    assert 1 <= len(long_lines) <= 0.05 * len(train_rows), long_lines
    dev_rows = [c for c in dev_rows if _first_loss_token(tokenizer, c) < max_length]
    train, dev = _write(tmp_path / "train.jsonl", train_rows), _write(tmp_path / "dev.jsonl", dev_rows)

    cfg = DataConfig(train=str(train), validation=str(dev))
    encoded = prepare(cfg, tokenizer, max_length, None, "causal-lm").train
    assert encoded.dropped == long_lines
    assert len(encoded) == len(train_rows) - len(long_lines)

    spec = tmp_path / "chat.toml"
    adapter = '[adapter]\nmethod = "lora"\nr = 4\nalpha = 8\ndropout = 0.0\n'
    spec.write_text(
        adapter + lm_spec_text(tiny_llama, train, dev).replace("max_length = 48", f"max_length = {max_length}")
    )
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = start_study("chat", spec, url, tmp_path)
    shown = ", ".join(map(str, long_lines[:5]))
    said = f"data file {train}: {len(long_lines)} of {len(train_rows)} rows left out, as every token it trains on"
    assert said in result.stderr, result.stderr[-3000:]
    assert f"beyond model.max_length ({max_length}) (line{'s' if len(long_lines) > 1 else ''} {shown}" in result.stderr
    assert f"data file {dev}:" not in result.stderr, "a file that lost nothing is not mentioned"
    (trial,) = optuna.load_study(study_name="chat", storage=url).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE


def test_a_file_with_a_third_of_its_real_rows_too_long_is_refused_with_the_fix(
    cli: Cli, tmp_path: Path, tiny_llama: Path, sst2_chat: list[list[dict[str, str]]]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    rows = sst2_chat[:90]
    max_length = _length_dropping([_first_loss_token(tokenizer, c) for c in rows], 1 / 3)
    train = _write(tmp_path / "train.jsonl", rows)
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_llama, train, train).replace("max_length = 48", f"max_length = {max_length}"))
    line = assert_refused(cli, spec, tmp_path, f"data file {train}: 3")
    assert "of 90 rows (3" in line and "more than data.max_dropped_share (0.05)" in line, line
    assert "raise model.max_length, shorten those rows, or raise data.max_dropped_share" in line, line
    # A larger share allowed: the same file trains (checked without a search: it is the rule, not the loop).
    cfg = DataConfig(train=str(train), validation=str(train), max_dropped_share=0.5)
    assert 25 <= len(prepare(cfg, tokenizer, max_length, None, "causal-lm").train.dropped) <= 35
