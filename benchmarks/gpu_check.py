"""The checks that need a GPU, run as one script when a lease gives us one (benchmarks/gpu_check.sh).

Each check is a real `hpsearch start` on the GPU, on a model built here from a config (the
machine has no hub access) and synthetic data, and prints what the trial recorded:

1. bf16 MFU of BERT-base (110M parameters, sequence length 128): tokens/s, MFU, peak memory;
2. the NCCL multi-device path (``devices_per_trial = 2``), when the machine has two GPUs;
3. one LoRA trial (r 16, bf16, sequence length 1024) on a randomly initialised Llama of
   Qwen2.5-0.5B's shape, and the same base in 4 bits when bitsandbytes loads.

A check that cannot run says why and the others go on. Figures go to benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(2000)] + ["good", "bad", "great", "awful"]


def tokenizer(folder: Path) -> Any:
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def bert_base(folder: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    tok = tokenizer(folder)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), num_labels=2))
    model.save_pretrained(folder)
    return folder


def llama_qwen_shape(folder: Path) -> Path:
    """A random Llama with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer(folder)
    cfg = LlamaConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def classification_rows(path: Path, n: int, words: int) -> Path:
    rng = random.Random(n)
    with path.open("w") as f:
        for _ in range(n):
            label = rng.random() < 0.5
            text = [rng.choice(WORDS[:2000]) for _ in range(words)] + ["good" if label else "bad"]
            rng.shuffle(text)
            f.write(json.dumps({"text": " ".join(text), "label": "pos" if label else "neg"}) + "\n")
    return path


def text_rows(path: Path, n: int, words: int) -> Path:
    rng = random.Random(n)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")
    return path


def run(name: str, spec: str, work: Path, devices: str = "0") -> dict[str, Any] | None:
    """`hpsearch start` with one trial; the trial's recorded attributes, or None."""
    folder = work / name
    folder.mkdir()
    (folder / "spec.toml").write_text(spec)
    started = time.monotonic()
    storage = f"sqlite:///{folder / 'study.db'}"
    argv = ["start", "--study", name, "--config", "spec.toml", "--devices", devices, "--storage", storage]
    out = subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli", *argv, "--output-dir", "runs"],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    print(f"== {name}: exit {out.returncode} in {time.monotonic() - started:.0f} s")
    if out.returncode != 0:
        print(out.stderr[-3000:])
        return None
    import optuna

    [trial] = optuna.load_study(study_name=name, storage=f"sqlite:///{folder / 'study.db'}").trials
    keys = ("precision", "train_tokens_per_second", "train_samples_per_second", "mfu", "peak_memory_mb")
    shown = {k: trial.user_attrs.get(k) for k in (*keys, "trainable_parameters", "devices")}
    print(f"   state {trial.state.name}, value {trial.value}: {json.dumps(shown)}")
    return dict(trial.user_attrs)


def spec(model: Path, train: Path, dev: Path, *, task: str, max_length: int, batch: int, micro: int, extra: str) -> str:
    metric = "loss"
    return f"""
[model]
name = "{model}"
task = "{task}"
max_length = {max_length}
{extra}
[data]
train = "{train}"
validation = "{dev}"
[train]
learning_rate = 1e-4
batch_size = {batch}
micro_batch_size = {micro}
epochs = 1
eval_every = 1000000
precision = "auto"
[search]
n_trials = 1
sampler = "random"
pruner = "none"
metric = "{metric}"
prune_at_chance = 0
[search.space]
learning_rate = {{ type = "float", low = 1e-4, high = 2e-4, log = true }}
"""


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    bert = bert_base(work / "bert-base")
    train = classification_rows(work / "cls-train.jsonl", 16384, 120)
    dev = classification_rows(work / "cls-dev.jsonl", 1024, 120)
    cls = spec(bert, train, dev, task="classification", max_length=128, batch=64, micro=64, extra="")
    run("bert-base-bf16", cls, work)
    if torch.cuda.device_count() >= 2:
        run("bert-base-nccl", cls.replace("[train]", "[train]\ndevices_per_trial = 2"), work, devices="0,1")
    else:
        print("== bert-base-nccl: skipped (one GPU; the NCCL path needs two)")
    llama = llama_qwen_shape(work / "llama-qwen0.5b")
    lm_train, lm_dev = text_rows(work / "lm-train.jsonl", 2048, 1100), text_rows(work / "lm-dev.jsonl", 64, 1100)
    lora = '[adapter]\nmethod = "lora"\nr = 16\nalpha = 32\ntarget_modules = "all-linear"'
    lm = spec(llama, lm_train, lm_dev, task="causal-lm", max_length=1024, batch=16, micro=8, extra="")
    run("llama-lora-bf16", lm + "\n" + lora + "\n", work)
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:
        print(f"== llama-qlora-4bit: skipped (bitsandbytes does not load: {exc})")
    else:
        quantized = lm.replace('task = "causal-lm"', 'task = "causal-lm"\nquantization = "4bit"')
        run("llama-qlora-4bit", quantized + "\n" + lora + "\n", work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
