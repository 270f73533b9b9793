"""A tiny BERT and a tiny GPT-2 with their tokenizers, built locally (no hub), for fast real training on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hpsearch.search.presets import demo_data, tiny_gpt2
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.storage.trialdir import BEST, CURVES, OUT_OF_MEMORY_FILE, RESUME, RESUME_FILE
from hpsearch.trainer.checkpoint import RunFiles
from hpsearch.trainer.config import TrainConfig
from hpsearch.trainer.encoding import Prepared
from hpsearch.trainer.loop import Run, fit
from hpsearch.trainer.model import PretrainedCache
from hpsearch.trainer.report import TrainResult

Trained = tuple[torch.nn.Module, TrainResult, NullReporter]


def build_tiny_bert(folder: Path, *, hidden: int = 32, layers: int = 2, dropout: float = 0.1) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = sorted(
        {w.strip(",") for row in demo_data.generate(2000, seed=99) for w in row["text"].split()}
        | {"good", "bad", "great", "terrible", "fine"}
    )
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

    tokens = [*specials, ",", *words]
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)
    tokenizer.save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(specials) + 1 + len(words),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    import torch

    # Seeded: the same weights every run, so tolerance-based comparisons cannot flake on a draw.
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def write_demo_split(path: Path, n: int, seed: int, *, label_as: str = "string") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in demo_data.generate(n, seed):
            label: object = row["label"] if label_as == "string" else int(row["label"] == "positive")
            f.write(json.dumps({"text": row["text"], "label": label}) + "\n")
    return path


def build_tiny_gpt2(folder: Path, *, dropout: float = 0.1) -> Path:
    """The gpt2-lr preset's tiny causal LM (2 layers, 64 wide, byte-level BPE), built locally."""
    return tiny_gpt2.build(folder, dropout=dropout)


def build_tiny_llama(folder: Path, tokenizer_from: Path, dtype: torch.dtype) -> Path:
    """A tiny Llama (2 layers, 64 wide) whose config and weights are stored in ``dtype``, as current LLM checkpoints
    are in bf16; the same seeded weights whatever ``dtype`` (rounded to it), the tokenizer of ``tokenizer_from``."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(folder)
    for file in tokenizer_from.iterdir():
        if "token" in file.name or file.name in ("vocab.json", "merges.txt"):
            shutil.copy(file, folder / file.name)
    return folder


def write_lm_split(path: Path, n: int, seed: int, *, pairs: bool = False) -> Path:
    """Causal-LM rows: {"text": ...}, or {"prompt": review, "response": verdict} with ``pairs``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in demo_data.generate(n, seed):
            if pairs:
                record = {"prompt": f"{row['text']}. verdict:", "response": f" {row['label']}"}
            else:
                record = {"text": f"{row['text']}. verdict: {row['label']}"}
            f.write(json.dumps(record) + "\n")
    return path


def files_in(out: Path) -> RunFiles:
    """A run's files laid out in ``out`` as in a trial's folder (``out/best``, ``out/resume/state.pt``, ...)."""
    return RunFiles(out / BEST, out / RESUME / RESUME_FILE, out / CURVES, out / RESUME / OUT_OF_MEMORY_FILE)


def tiny_run(model_dir: Path, prepared: tuple[Any, Prepared], cfg: TrainConfig, out: Path, **run: Any) -> Run:
    """The trainer's Run for a fresh model from ``model_dir`` on CPU, minimising the loss
    unless ``run`` says otherwise; ``run`` sets further fields (metric, resume_from, should_stop, ...)."""
    tok, data = prepared
    assert data.labels is not None
    model = PretrainedCache().fresh(str(model_dir), data.labels.num_labels, data.labels.id2label(), cfg.seed)
    return Run(
        model=model,
        tokenizer=tok,
        data=data,
        cfg=cfg,
        device=torch.device("cpu"),
        files=files_in(out),
        **{"metric": "loss", **run},
    )


def train_tiny(model_dir: Path, prepared: tuple[Any, Prepared], cfg: TrainConfig, out: Path, **run: Any) -> Trained:
    """One real fine-tune on CPU outside any search: (model, result, what it reported)."""
    built = tiny_run(model_dir, prepared, cfg, out, **run)
    reporter = NullReporter()
    return built.model, fit(built, reporter), reporter
