"""Chat data: assistant-only labels under real chat templates, bad conversations refused, a LoRA chat trial."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpsearch.search.presets import tiny_llama_chat
from hpsearch.trainer.batching import collate
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.task_names import IGNORE_INDEX
from tests.conftest import assert_refused, lm_spec_text, one_trial
from tests.support.chat_templates import LLAMA3, QWEN25, SPECIALS

CONVERSATION = [
    {"role": "system", "content": "you judge reviews"},
    {"role": "user", "content": "the movie was dull"},
    {"role": "assistant", "content": "negative"},
    {"role": "user", "content": "the plot was clever"},
    {"role": "assistant", "content": "positive"},
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lora-chat preset's model, not pre-trained (fast): a Llama with a ChatML chat template."""
    return tiny_llama_chat.build(tmp_path_factory.mktemp("tiny-llama") / "model", pretrain_steps=0)


def _tokenizer(template: str, bos: str) -> Any:
    texts = [m["content"] for m in CONVERSATION] + [
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ]
    tokenizer = tiny_llama_chat.chat_tokenizer(texts * 20, SPECIALS, vocab=400, template=template)
    tokenizer.bos_token = bos
    return tokenizer


def _write(path: Path, *rows: Any) -> Path:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path


def _segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive labelled tokens."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if label == IGNORE_INDEX:
            continue
        assert label == token, "a labelled token is trained to be itself (the shift happens in the loss)"
        if i and labels[i - 1] != IGNORE_INDEX:
            runs[-1].append(token)
        else:
            runs.append([token])
    return runs


@pytest.mark.parametrize(
    "template,bos,end",
    [(QWEN25, "<|endoftext|>", "<|im_end|>"), (LLAMA3, "<|begin_of_text|>", "<|eot_id|>")],
    ids=["qwen2.5", "llama3"],
)
def test_only_assistant_turns_carry_labels_under_real_templates(
    tmp_path: Path, template: str, bos: str, end: str
) -> None:
    tok = _tokenizer(template, bos)
    data_file = _write(tmp_path / "chat.jsonl", CONVERSATION, CONVERSATION[:3])
    cfg = DataConfig(train=str(data_file), validation=str(data_file))
    data = prepare(cfg, tok, 256, tmp_path / "cache", "causal-lm")
    ids, labels = data.train.input_ids[0], data.train.token_labels[0]
    assert ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    assert [tok.decode(run) for run in _segments(ids, labels)] == [f"negative{end}", f"positive{end}"]
    masked = tok.decode([t for t, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX])
    for message in CONVERSATION[:2] + CONVERSATION[3:4]:
        assert message["content"] in masked, "system and user text is never trained on"
    assert "negative" not in masked and "positive" not in masked
    # The loss averages over the assistant's tokens only, and the collated labels are these.
    assert data.train.targets([0]) == sum(map(len, _segments(ids, labels)))
    batch = collate(data.train, [0, 1], data.pad_id)
    assert batch["labels"][0].tolist() == labels
    assert (batch["labels"][1][len(data.train.input_ids[1]) :] == IGNORE_INDEX).all(), "padding is not trained on"
    # The token cache stores the labels: a second prepare reads them back.
    again = prepare(cfg, tok, 256, tmp_path / "cache", "causal-lm")
    assert again.train.token_labels == data.train.token_labels


def test_truncation_keeps_labels_aligned(tmp_path: Path) -> None:
    tok = _tokenizer(QWEN25, "<|endoftext|>")
    data_file = _write(tmp_path / "chat.jsonl", CONVERSATION)
    cfg = DataConfig(train=str(data_file), validation=str(data_file))
    full = prepare(cfg, tok, 256, None, "causal-lm").train
    n = len(full.input_ids[0]) - 3  # cuts into the last assistant turn
    cut = prepare(cfg, tok, n, None, "causal-lm").train
    assert cut.input_ids[0] == full.input_ids[0][:n]
    assert cut.token_labels[0] == full.token_labels[0][:n]
    assert len(cut.token_labels[0]) == len(cut.input_ids[0]) == n


USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}
BAD_CHAT = [
    ("not_a_list", '{"messages": "hi"}\n', "line 1: 'messages' must be a non-empty list of messages"),
    ("no_role", json.dumps({"messages": [{"content": "x"}]}) + "\n", 'message 1 must be an object with "role"'),
    (
        "content_not_string",
        json.dumps({"messages": [USER, {"role": "assistant", "content": 3}]}) + "\n",
        "line 1: 'messages': message 2: content must be a string, got 3",
    ),
    (
        "unknown_role",
        json.dumps({"messages": [{"role": "robot", "content": "x"}, ASSISTANT]}) + "\n",
        'message 1 has role "robot"; roles are system, user, assistant, tool',
    ),
    (
        "no_assistant",
        json.dumps({"messages": [USER, ASSISTANT]}) + "\n" + json.dumps({"messages": [USER]}) + "\n",
        "line 2: 'messages': the conversation has no assistant turn",
    ),
    (
        "assistant_cut_off",
        json.dumps({"messages": [{"role": "user", "content": "the movie was dull " * 30}, ASSISTANT]}) + "\n",
        "every row (1) is left out, as every token it trains on (the response, the assistant's turns) lies beyond "
        "model.max_length (48) (line 1); raise model.max_length",
    ),
]


@pytest.mark.parametrize("name,rows,expected", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_data_exits_2_with_one_line_and_writes_nothing(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, tiny_llama: Path, name: str, rows: str, expected: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(rows)
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_llama, bad, _write(tmp_path / "ok.jsonl", [USER, ASSISTANT])))
    line = assert_refused(cli, spec, tmp_path, expected)
    assert str(bad) in line, "the message names the file"


def test_chat_data_on_a_tokenizer_without_a_chat_template(cli, tmp_path: Path, tiny_gpt2: Path) -> None:  # type: ignore[no-untyped-def]
    data_file = _write(tmp_path / "chat.jsonl", [USER, ASSISTANT])
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_gpt2, data_file, data_file))
    assert_refused(cli, spec, tmp_path, "line 1 is chat data, but the tokenizer of")
    assert_refused(cli, spec, tmp_path, 'tokenizer_config.json has "chat_template"')


def test_the_lora_chat_builder_makes_a_llama_with_a_chat_template(tiny_llama: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert tok.chat_template == tiny_llama_chat.CHAT_TEMPLATE
    assert AutoConfig.from_pretrained(str(tiny_llama)).model_type == "llama"
    text = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_lora_chat_trial_from_the_cli_saves_an_adapter_that_peft_loads(tmp_path: Path, tiny_llama: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    train, dev = root / "train.jsonl", root / "dev.jsonl"
    for path, n, seed in ((train, 96, 1), (dev, 32, 2)):
        _write(path, *tiny_llama_chat.conversations(n, seed))
    spec = tmp_path / "chat.toml"
    adapter = '[adapter]\nmethod = "lora"\nr = 4\nalpha = 8\ndropout = 0.0\n'
    spec.write_text(adapter + lm_spec_text(tiny_llama, train, dev, search="[[search.enqueue]]\nlearning_rate = 1e-2"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("chat", spec, url, tmp_path)
    values = [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]
    assert values[-1] < values[0], f"the validation loss on the assistant's tokens must fall: {values}"
    folder = Path(trial.user_attrs["best_checkpoint"])
    assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_the_lora_chat_preset_searches_lora_on_the_shipped_chat_data() -> None:
    from hpsearch.search.presets import PRESETS, locate, preset_file
    from hpsearch.search.study.spec import load_file

    assert "lora-chat" in PRESETS
    path = preset_file("lora-chat")
    assert path is not None
    spec = load_file(path)
    assert spec.model.name == "builtin://tiny-llama-chat" and spec.adapter.method == "lora"
    assert {"learning_rate", "adapter.r", "adapter.alpha"} <= set(spec.space)
    rows = [json.loads(line) for line in Path(locate(spec.data.train)).read_text().splitlines()]
    assert len(rows) == 400 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
