"""The checks that need a GPU, run as one script when a lease gives us one (benchmarks/gpu_check.sh).

    python benchmarks/gpu_check.py                  # on the GPU machine: every part, ~8 minutes on an H200
    python benchmarks/gpu_check.py --tiny           # every part on tiny shapes, on a CPU, in ~2 minutes
    python benchmarks/gpu_check.py --only lora --part-seconds lora=300

Four parts, each in its own process with its own time limit (``--part-seconds``): a part that
runs over is killed and reported as such, and the next one still runs. Models are randomly
initialised from a config (the machine has no hub access), data is synthetic, and every
hpsearch figure is what a real ``hpsearch start`` trial recorded:

1. ``nccl``: the multi-device path. With two GPUs or more, a BERT-base trial with
   ``devices_per_trial = 2`` (DDP over NCCL). With one GPU, what one GPU allows: a 1-rank NCCL
   group joined through hpsearch's ``distributed.join`` (loopback store, gloo control group),
   timed all-reduces, a DDP step, a control broadcast and a gather. ``--tiny`` runs both on CPU
   ranks (gloo).
2. ``bert``: bf16 MFU of BERT-base (sequence length 128) through hpsearch's trainer, and the same trial through
   ``transformers.Trainer`` (issue 60: the one-trial comparison on a GPU; train and wall time ratios).
3. ``lora``: a LoRA trial (r 16, bf16, sequence length 1024) on a Llama of Qwen2.5-0.5B's shape,
   through hpsearch and through ``transformers.Trainer`` + peft on the same model, the same
   token ids, precision, batch, micro-batch, learning rate and steps.
4. ``qlora``: when bitsandbytes imports and CUDA is there, the same in 4 bits (NF4, double
   quantization, bf16 compute) on a Llama of Llama-3-8B's shape. The random 8B base is built
   on the GPU in bf16 (no fp32 copy anywhere, none on the host), saved to the work folder as
   a bf16 checkpoint, and loaded by each side through bitsandbytes' quantizing load
   (hpsearch's ``model.quantization = "4bit"``; ``BitsAndBytesConfig`` +
   ``prepare_model_for_kbit_training`` for the Trainer). The Trainer side runs if the time
   left in the part's budget is more than the hpsearch side took.

Tokens/s are real (unpadded) training tokens over training time; MFU is hpsearch's formula
(``flops_per_token``: 6 x trained + 4 x frozen weights, embedding tables left out, 4-bit
weights at their full size) over the GPU's peak bf16 rate, for both sides; peak memory is
``torch.cuda.max_memory_allocated`` over the training (the resident model included). On a
CPU there is no MFU and peak memory is the process's peak resident set.

Each part ends with one ``SUMMARY`` line; all of them are printed again at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import LORA_DEFAULTS

PARTS = ("nccl", "bert", "lora", "qlora")
WORDS = [f"w{i}" for i in range(2000)] + ["good", "bad", "great", "awful"]


@dataclass(frozen=True)
class Shapes:
    """The sizes of every part: the GPU run's, or ``--tiny``'s."""

    budget: dict[str, int]
    """Seconds each part may take before it is stopped (``--part-seconds`` overrides)."""
    bert: dict[str, Any]
    bert_rows: int
    bert_words: int
    bert_length: int
    bert_batch: int
    bert_steps: int
    llama: dict[str, Any]
    lm_rows: int
    lm_words: int
    lm_length: int
    lm_batch: int
    lm_micro: int
    lm_steps: int
    big: dict[str, Any]
    big_batch: int
    big_micro: int
    big_steps: int
    all_reduce_mb: int
    precision: str = "bf16"
    lora: dict[str, Any] = field(default_factory=lambda: dict(LORA_DEFAULTS))


QWEN_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
GPU = Shapes(
    # About 9 minutes if every part used all of its budget; they should take less.
    budget={"nccl": 45, "bert": 150, "lora": 150, "qlora": 210},
    bert={},  # BertConfig's defaults are BERT-base's
    bert_rows=32768,
    bert_words=120,
    bert_length=128,
    bert_batch=64,
    bert_steps=400,
    llama=QWEN_05B,
    lm_rows=1024,
    lm_words=1100,
    lm_length=1024,
    lm_batch=16,
    lm_micro=8,
    lm_steps=48,
    big=LLAMA3_8B,
    big_batch=8,
    big_micro=4,
    big_steps=8,
    all_reduce_mb=256,
)
SMALL = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""--tiny's Llamas: the shapes above, this small (each keeps its embedding tying)."""
TINY = Shapes(
    budget={"nccl": 30, "bert": 90, "lora": 75, "qlora": 30},  # --two-cpu-ranks: nccl 150
    bert={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128},
    bert_rows=256,
    bert_words=30,
    bert_length=32,
    bert_batch=16,
    bert_steps=8,
    llama={**QWEN_05B, **SMALL},
    lm_rows=64,
    lm_words=80,
    lm_length=64,
    lm_batch=8,
    lm_micro=4,
    lm_steps=4,
    big={**LLAMA3_8B, **SMALL},
    big_batch=4,
    big_micro=2,
    big_steps=2,
    all_reduce_mb=1,
    precision="auto",  # bf16 is emulated, and slow, on most CPUs: fp32 there
)


# -- models and data ----------------------------------------------------------------------


def tokenizer(folder: Path) -> Any:
    """A word-level BERT tokenizer over WORDS: every word one token, no downloads."""
    # transformers 5 made BertTokenizer the fast one and keeps this name as an alias its stubs lack.
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def bert(folder: Path, shapes: Shapes) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    tok = tokenizer(folder)
    config = BertConfig(vocab_size=len(tok), **shapes.bert)
    config.num_labels = 2
    model = BertForSequenceClassification(config)
    model.save_pretrained(folder)
    return folder


def llama(folder: Path, shape: dict[str, Any], max_length: int) -> Path:
    """A random Llama of ``shape``, saved in bf16. Built on the GPU when there is one and in
    bf16 from the start: an 8B model is 16 GB that way, where fp32 on the host would be 32."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = tokenizer(folder)
    cfg = LlamaConfig(
        **shape,
        max_position_embeddings=max(2048, max_length),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id,
    )
    started = time.monotonic()
    # The default dtype, not from_config's keyword: transformers 4 calls it torch_dtype, 5 dtype.
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(dtype)
    model.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"   built {parameters / 1e6:,.1f}M-parameter Llama in bf16, saved in {time.monotonic() - started:.0f} s")
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


# -- hpsearch's side: one real `hpsearch start` -------------------------------------------


def spec(
    model: Path,
    train: Path,
    dev: Path,
    *,
    task: str,
    max_length: int,
    batch: int,
    micro: int,
    steps: int,
    precision: str,
    extra: str = "",
) -> str:
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
max_steps = {steps}
eval_every = 1000000
warmup_ratio = 0.0
weight_decay = 0.0
max_grad_norm = 1.0
precision = "{precision}"
[search]
n_trials = 1
sampler = "random"
pruner = "none"
metric = "loss"
prune_at_chance = 0
[search.space]
learning_rate = {{ type = "float", low = 1e-4, high = 2e-4, log = true }}
"""


def lora_table(lora: dict[str, Any]) -> str:
    return (
        f'[adapter]\nmethod = "lora"\nr = {lora["r"]}\nalpha = {lora["alpha"]}\ndropout = {lora["dropout"]}\n'
        f'target_modules = "{lora["target_modules"]}"\n'
    )


def hpsearch_trial(name: str, spec_text: str, work: Path, devices: str) -> dict[str, Any]:
    """`hpsearch start` with one trial; what the trial recorded (its user attributes, its
    learning rate and the whole command's wall time). Raises when the trial did not complete."""
    folder = work / name
    folder.mkdir()
    (folder / "spec.toml").write_text(spec_text)
    storage = f"sqlite:///{folder / 'study.db'}"
    argv = ["start", "--study", name, "--config", "spec.toml", "--devices", devices, "--storage", storage]
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli.main", *argv, "--output-dir", "runs"],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    wall = time.monotonic() - started
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name=name, storage=storage).trials if out.returncode == 0 else []
    if not trials or trials[0].state.name != "COMPLETE":
        state = trials[0].state.name if trials else "none"
        attrs = trials[0].user_attrs if trials else {}
        raise RuntimeError(f"{name}: exit {out.returncode}, trial {state} {attrs}\n{out.stderr[-3000:]}")
    trial = trials[0]
    print(f"   {name}: hpsearch start took {wall:.0f} s, trial value {trial.value:.4f}")
    return {**trial.user_attrs, "learning_rate": trial.params["learning_rate"], "wall_seconds": round(wall, 1)}


def hpsearch_figures(attrs: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "precision",
        "train_tokens_per_second",
        "mfu",
        "peak_memory_mb",
        "train_seconds",
        "train_padding_ratio",
        "trainable_parameters",
    )
    shown = {k: attrs.get(k) for k in keys}
    shown.update(first_step_seconds=attrs.get("first_step_seconds"), wall_seconds=attrs.get("wall_seconds"))
    return shown


def devices_flag() -> str:
    import torch

    return "0" if torch.cuda.is_available() else "cpu"


# -- the Trainer's side: transformers.Trainer + peft on the same model and token ids -------


def trainer_side(
    model_dir: Path, train: Path, dev: Path, shapes: Shapes, lr: float, precision: str, quantized: bool
) -> dict[str, Any]:
    """One LoRA fine-tune with ``transformers.Trainer`` + peft: the same base (read from the
    same folder), the token ids hpsearch trained on (its own tokenisation, so the data cannot
    differ), the same LoRA config, precision, batch, micro-batch (as gradient accumulation),
    learning rate, linear schedule without warm-up, clipping and steps; no saving, no evaluation."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

    from hpsearch.trainer.adapters import quantization_config
    from hpsearch.trainer.config import DataConfig, ModelConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.model import load_tokenizer

    max_length = shapes.lm_length
    batch, micro = (shapes.big_batch, shapes.big_micro) if quantized else (shapes.lm_batch, shapes.lm_micro)
    steps = shapes.big_steps if quantized else shapes.lm_steps
    tok = load_tokenizer(str(model_dir))
    data = prepare(DataConfig(train=str(train), validation=str(dev)), tok, max_length, None, task="causal-lm")
    rows = [
        {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * p + ids[p:]}
        for ids, p in zip(data.train.input_ids, data.train.prompt_lengths, strict=True)
    ]
    # Loaded as hpsearch's load_model loads it (no dtype: the transformers version's default).
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
    if quantized:
        kwargs.update(quantization_config=quantization_config(ModelConfig(quantization="4bit")), device_map={"": 0})
    started = time.monotonic()
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = shapes.lora
    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    pad = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    counted = {"tokens": 0}

    def collate(features: list[dict[str, Any]]) -> Any:
        counted["tokens"] += sum(len(f["input_ids"]) for f in features)  # real tokens, as hpsearch counts
        return pad(features)

    cuda = torch.cuda.is_available()
    seconds = _trainer_train(model, rows, collate, model_dir.parent / "trainer-out", batch, micro, steps, lr, precision)
    figures = _trainer_figures(model, precision, counted["tokens"], seconds, started)
    figures["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return figures


def bert_trainer_side(model_dir: Path, train: Path, shapes: Shapes, lr: float, precision: str) -> dict[str, Any]:
    """One BERT-base classification fine-tune with ``transformers.Trainer``: the same folder, the token ids hpsearch
    trained on, padded per batch by ``DataCollatorWithPadding`` (the Trainer's default) over random batches, the
    same precision, batch, learning rate, linear schedule without warm-up, clipping and steps; no saving, no
    evaluation. Wall time from the model load to the end of training, as hpsearch's trial is timed."""
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.model import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    data = prepare(DataConfig(train=str(train), validation=str(train)), tok, shapes.bert_length, None)
    rows = [
        {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label}
        for ids, label in zip(data.train.input_ids, data.train.labels, strict=True)
    ]
    started = time.monotonic()
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=2, attn_implementation="sdpa")
    pad = DataCollatorWithPadding(tok)
    counted = {"tokens": 0, "padded": 0}

    def collate(features: list[dict[str, Any]]) -> Any:
        batch = pad(features)
        counted["tokens"] += int(batch["attention_mask"].sum())  # real tokens, as hpsearch counts
        counted["padded"] += batch["attention_mask"].numel()
        return batch

    cuda = torch.cuda.is_available()
    batch = shapes.bert_batch
    seconds = _trainer_train(
        model, rows, collate, model_dir.parent / "bert-trainer-out", batch, batch, shapes.bert_steps, lr, precision
    )
    figures = _trainer_figures(model, precision, counted["tokens"], seconds, started)
    figures["train_padding_ratio"] = round(counted["padded"] / max(counted["tokens"], 1), 3)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return figures


def _trainer_train(
    model: Any, rows: Any, collate: Any, out: Path, batch: int, micro: int, steps: int, lr: float, precision: str
) -> float:
    """``transformers.Trainer`` on hpsearch's settings (linear decay without warm-up, no weight decay, clipping at
    1, seed 0; no evaluation, saving or logging): its train_runtime in seconds."""
    import torch
    from transformers import Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=precision == "bf16",
        use_cpu=not cuda,
        seed=0,
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # after the Trainer put the model on the GPU, as hpsearch's figure
    return float(trainer.train().metrics["train_runtime"])


def _trainer_figures(model: Any, precision: str, tokens: int, seconds: float, started: float) -> dict[str, Any]:
    """What both Trainer sides report, under the keys hpsearch's trial figures use (wall from ``started``)."""
    from hpsearch.trainer.step import flops_per_token

    return {
        "precision": precision,
        "train_tokens_per_second": round(tokens / seconds, 1),
        "mfu": _mfu(flops_per_token(model), tokens, seconds),
        "peak_memory_mb": round(_peak_mb(), 1),
        "train_seconds": round(seconds, 3),
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def _mfu(flops: float, tokens: int, seconds: float) -> float | None:
    import torch

    from hpsearch.trainer.stats import mfu, peak_tflops

    peak = peak_tflops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    return round(mfu(flops, tokens, seconds, peak * 1e12), 4) if peak else None


def _peak_mb() -> float:
    import torch

    from hpsearch.trainer.stats import peak_memory_mb

    return peak_memory_mb(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# -- the parts ----------------------------------------------------------------------------


class Record(dict[str, Any]):
    """A part's results, written to its file (and printed) as each comes in: a part stopped at
    its time limit still reports what it finished."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self))
        print(f"   {key}: {json.dumps(value)}", flush=True)


@dataclass
class Part:
    """What a part is given: its folder, the shapes, its time limit and where its results go."""

    work: Path
    shapes: Shapes
    tiny: bool
    two_cpu_ranks: bool
    seconds: float
    out: Record
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def part_nccl(part: Part) -> None:
    import torch

    work, shapes = part.work, part.shapes
    gpus = torch.cuda.device_count()
    part.out["gpus"] = gpus
    if gpus < 2:
        part.out["one_rank"] = one_rank_group(shapes)
    if gpus >= 2 or part.two_cpu_ranks:
        # The real multi-device trial: on two GPUs over NCCL, or on two CPU ranks over gloo.
        model = bert(work / "bert-nccl", shapes)
        train = classification_rows(work / "nccl-train.jsonl", shapes.bert_rows, shapes.bert_words)
        dev = classification_rows(work / "nccl-dev.jsonl", 256, shapes.bert_words)
        text = spec(
            model,
            train,
            dev,
            task="classification",
            max_length=shapes.bert_length,
            batch=shapes.bert_batch,
            micro=shapes.bert_batch // 2,
            steps=shapes.bert_steps,
            precision=shapes.precision,
        ).replace("[train]", "[train]\ndevices_per_trial = 2")
        attrs = hpsearch_trial("bert-2-ranks", text, work, "0,1" if gpus >= 2 else "cpu:2")
        digests = attrs.get("rank_parameter_digests") or []
        part.out["two_ranks"] = {
            **hpsearch_figures(attrs),
            "devices": attrs.get("devices"),
            "digests_equal": len(digests) == 2 and len(set(digests)) == 1,
        }
    elif part.tiny:
        part.out["two_ranks"] = "skipped: --two-cpu-ranks runs it on two CPU ranks (gloo)"
    else:
        part.out["two_ranks"] = "skipped: one GPU (NCCL cannot put two ranks on one device)"


def one_rank_group(shapes: Shapes) -> dict[str, Any]:
    """What one device allows of the multi-device path: hpsearch's rendezvous and join (NCCL on a
    GPU, gloo on a CPU), its control group, timed all-reduces and one DDP step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpsearch.trainer import distributed

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    started = time.monotonic()
    store = distributed.main_store(1)
    world = distributed.join(0, 1, store.port, device, store=store)
    joined = time.monotonic() - started
    backend = dist.get_backend()
    # The rendezvous must listen on loopback only (see distributed.main_store).
    listens_on = _listening_address(store.port)
    tensor = torch.ones(shapes.all_reduce_mb * 2**20 // 4, device=device)
    dist.all_reduce(tensor)  # the first call sets up the communicator
    _sync(device)
    t0, rounds = time.perf_counter(), 10
    for _ in range(rounds):
        dist.all_reduce(tensor)
    _sync(device)
    per_call = (time.perf_counter() - t0) / rounds
    flag = torch.tensor([1])
    dist.broadcast(flag, src=0, group=world.control)
    gathered = world.gather({"rank": world.rank})
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device),
        device_ids=[0] if device.type == "cuda" else None,
    )
    loss = model(torch.randn(32, 256, device=device)).square().mean()
    loss.backward()
    ddp_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    dist.destroy_process_group()  # World.close() does it only for several ranks
    return {
        "backend": backend,
        "join_seconds": round(joined, 2),
        "store_listens_on": listens_on,
        "all_reduce_mb": shapes.all_reduce_mb,
        "all_reduce_ms": round(per_call * 1e3, 3),
        "all_reduce_gb_per_s": round(shapes.all_reduce_mb / 1024 / per_call, 1),
        "control_broadcast": int(flag.item()),
        "gather": gathered,
        "ddp_step_ok": ddp_ok,
    }


def _listening_address(port: int) -> str:
    """The address the store's port answers on: 127.0.0.1 alone, or a wider one too."""
    try:
        outside = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1 (no other address to try)"
    if outside.startswith("127."):
        return "127.0.0.1 (the host name resolves to loopback)"
    try:
        socket.create_connection((outside, port), timeout=1.0).close()
    except OSError:
        return f"127.0.0.1 only (refused on {outside})"
    return f"also {outside}: NOT loopback only"


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def part_bert(part: Part) -> None:
    work, shapes = part.work, part.shapes
    model = bert(work / "bert-base", shapes)
    train = classification_rows(work / "cls-train.jsonl", shapes.bert_rows, shapes.bert_words)
    dev = classification_rows(work / "cls-dev.jsonl", 512, shapes.bert_words)
    text = spec(
        model,
        train,
        dev,
        task="classification",
        max_length=shapes.bert_length,
        batch=shapes.bert_batch,
        micro=shapes.bert_batch,
        steps=shapes.bert_steps,
        precision=shapes.precision,
    )
    attrs = hpsearch_trial("bert-trial", text, work, devices_flag())
    part.out["hpsearch"] = ours = hpsearch_figures(attrs)
    # Issue 60: the same trial through transformers.Trainer (bf16, the same rows, batch, steps and learning rate).
    part.out["transformers"] = theirs = bert_trainer_side(
        model, train, shapes, attrs["learning_rate"], attrs["precision"]
    )
    # Training time only: hpsearch's wall_seconds is a whole `hpsearch start` (process, imports), the Trainer's is
    # from its model load.
    if ours.get("train_seconds") and theirs.get("train_seconds"):
        part.out["train_seconds_transformers_over_hpsearch"] = round(theirs["train_seconds"] / ours["train_seconds"], 3)


def part_lora(part: Part) -> None:
    lora_pair(part, quantized=False)


def part_qlora(part: Part) -> None:
    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA device")
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library it cannot load
        missing.append(f"bitsandbytes does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    if missing:
        # What does not need CUDA still runs: the bf16 checkpoint the 4-bit load would read.
        llama(part.work / "llama-8b-shape", part.shapes.big, part.shapes.lm_length)
        part.out["skipped"] = "; ".join(missing) + " (the bf16 random checkpoint was built and saved)"
        return
    lora_pair(part, quantized=True)


def lora_pair(part: Part, *, quantized: bool) -> None:
    """hpsearch's LoRA trial, then the Trainer's on the same folder, data and settings (for the
    4-bit base only if the part's time left is more than hpsearch's side took)."""
    work, shapes = part.work, part.shapes
    name = "llama-8b-shape" if quantized else "llama-qwen0.5b-shape"
    model = llama(work / name, shapes.big if quantized else shapes.llama, shapes.lm_length)
    train = text_rows(work / f"{name}-train.jsonl", shapes.lm_rows, shapes.lm_words)
    dev = text_rows(work / f"{name}-dev.jsonl", 16, shapes.lm_words)
    batch, micro = (shapes.big_batch, shapes.big_micro) if quantized else (shapes.lm_batch, shapes.lm_micro)
    text = spec(
        model,
        train,
        dev,
        task="causal-lm",
        max_length=shapes.lm_length,
        batch=batch,
        micro=micro,
        steps=shapes.big_steps if quantized else shapes.lm_steps,
        precision=shapes.precision,
        extra='quantization = "4bit"' if quantized else "",
    )
    ours_started = time.monotonic()
    attrs = hpsearch_trial(f"{name}-lora", text + lora_table(shapes.lora), work, devices_flag())
    part.out["hpsearch"] = ours = hpsearch_figures(attrs)
    took = time.monotonic() - ours_started
    if quantized and part.left() < took * 1.2:
        part.out["transformers"] = f"skipped: {part.left():.0f} s left of the part's time, hpsearch's took {took:.0f} s"
        return
    part.out["transformers"] = theirs = trainer_side(
        model, train, dev, shapes, attrs["learning_rate"], attrs["precision"], quantized
    )
    if ours["train_tokens_per_second"] and theirs["train_tokens_per_second"]:
        ratio = ours["train_tokens_per_second"] / theirs["train_tokens_per_second"]
        part.out["tokens_per_second_hpsearch_over_transformers"] = round(ratio, 3)


RUNNERS = {"nccl": part_nccl, "bert": part_bert, "lora": part_lora, "qlora": part_qlora}


# -- running the parts, each in its own process with its own time limit -------------------


def run_part(name: str, args: argparse.Namespace, work: Path, seconds: int) -> dict[str, Any]:
    """The part in a child process of its own session (so that its `hpsearch start` and worker
    go with it); killed at ``seconds``. Its result, or what stopped it."""
    result_file = work / f"{name}.result.json"
    argv = [sys.executable, __file__, "--part", name, "--work", str(work), "--seconds", str(seconds)]
    started = time.monotonic()
    flags = [*(["--tiny"] if args.tiny else []), *(["--two-cpu-ranks"] if args.two_cpu_ranks else [])]
    child = subprocess.Popen([*argv, *flags], start_new_session=True)
    try:
        code: int | None = child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        _stop(child)
        code = None
    elapsed = time.monotonic() - started
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if code is None:
        result["stopped"] = f"over its {seconds} s limit after what is above; killed"
    elif code != 0:
        result["failed"] = f"exit {code} (its error is printed above)"
    return {**result, "part_seconds": round(elapsed, 1)}


def _stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the part's process group (the part, its hpsearch start, the worker); SIGKILL
    to what is left of it 10 s later."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10.0)
    # Also when the part itself ended: a grandchild may still hold the GPU.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def child_main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shapes = TINY if args.tiny else GPU
    work = Path(args.work)
    scratch = work / args.part
    scratch.mkdir()
    out = Record(work / f"{args.part}.result.json")
    RUNNERS[args.part](Part(scratch, shapes, args.tiny, args.two_cpu_ranks, float(args.seconds), out))
    return 0


def summary_line(name: str, result: dict[str, Any]) -> str:
    return f"SUMMARY {name}: {json.dumps(result, separators=(', ', ': '))}"


def budgets(shapes: Shapes, overrides: list[str]) -> dict[str, int]:
    """The default budgets, with ``--part-seconds`` applied: ``S`` for every part, ``NAME=S`` for one."""
    out = dict(shapes.budget)
    for item in overrides:
        name, _, value = item.rpartition("=")
        if name and name not in out:
            raise SystemExit(f"--part-seconds {item}: no part {name!r}; parts are {', '.join(PARTS)}")
        if not value.isdigit() or int(value) <= 0:
            raise SystemExit(f"--part-seconds {item}: the seconds must be a positive integer")
        for part in [name] if name else list(out):
            out[part] = int(value)
    return out


def describe() -> str:
    import torch
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for module in ("peft", "accelerate", "bitsandbytes"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except Exception as exc:
            versions.append(f"{module} not importable ({type(exc).__name__})")
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        gpus = f"no CUDA device, {torch.get_num_threads()} CPU threads"
    return f"{', '.join(versions)}; {gpus}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, runnable on a CPU in ~2 minutes")
    p.add_argument(
        "--two-cpu-ranks",
        action="store_true",
        help="with --tiny: also the two-rank trial (gloo) that two GPUs run over NCCL (~30 s more on 2 cores)",
    )
    p.add_argument("--only", nargs="+", choices=PARTS, default=None, help="run these parts only")
    p.add_argument(
        "--part-seconds",
        action="append",
        default=[],
        metavar="[PART=]S",
        help="time limit of every part (S) or of one (PART=S); repeatable",
    )
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # the child process of one part
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        return child_main(args)
    shapes = TINY if args.tiny else GPU
    limits = budgets(
        shapes, ["nccl=150", *args.part_seconds] if args.tiny and args.two_cpu_ranks else args.part_seconds
    )
    parts = [name for name in PARTS if not args.only or name in args.only]
    print(describe(), flush=True)
    print(f"parts {', '.join(parts)}; budgets (s) {json.dumps({n: limits[n] for n in parts})}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    lines, started = [], time.monotonic()
    for name in parts:
        print(f"== {name} (at most {limits[name]} s)", flush=True)
        line = summary_line(name, run_part(name, args, work, limits[name]))
        print(line, flush=True)
        lines.append(line)
    print(f"\n== all parts in {math.ceil(time.monotonic() - started)} s (work folder {work})")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
