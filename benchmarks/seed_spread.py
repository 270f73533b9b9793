"""How far one configuration's held-out accuracy moves with nothing but the training seed.

search_vs_hf compares the model each search picked on glue_dev (872 sentences), and issue 41 asks the two to be
within half a point. That is only a fair target if one configuration, trained again, lands within much less than
that. This script trains one fixed configuration with ``transformers.Trainer`` (HF's side of search_vs_hf, the
same subsets, model, batch, length and precision) once per training seed, and prints for each run the validation
accuracy and loss (the 256 rows a search picks on) and the glue_dev accuracy, then their spread and what it means
for a difference of two searches' picks pooled over three seeds. Run by hand:

    python benchmarks/seed_spread.py --data-dir ../shared/data/sst2 --threads 1 --seed 2 \
        --learning-rate 3.52e-4 --warmup-ratio 0.0775 --weight-decay 0.0905 --train-seeds 0 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import auto_precision, describe_machine
from search_vs_hf import model_dir, read_tsv, score_glue_dev, subsets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--dev-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="the subsets' draw (search_vs_hf's --seed)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--warmup-ratio", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = Path(tmp)
        train, dev = subsets(args)
        runs = [train_once(args, train, dev, s) for s in args.train_seeds]
    print(
        f"\nMiniLM on SST-2: {args.train_size} train / {args.dev_size} dev (subset seed {args.seed}), batch "
        f"{args.batch_size}, {args.epochs} epoch(s); learning_rate={args.learning_rate:g} "
        f"warmup_ratio={args.warmup_ratio:g} weight_decay={args.weight_decay:g}"
    )
    print(f"{'train seed':>10} {'val acc':>8} {'val loss':>9} {'glue_dev':>9}")
    for s, (acc, loss, glue) in zip(args.train_seeds, runs, strict=True):
        print(f"{s:>10} {acc:>8.4f} {loss:>9.4f} {glue:>9.4f}")
    glue = [r[2] for r in runs]
    sd = statistics.stdev(glue) if len(glue) > 1 else float("nan")
    print(f"glue_dev: mean {statistics.mean(glue):.4f}, sd {sd:.4f}, range {min(glue):.4f}..{max(glue):.4f}")
    if len(runs) > 2:
        acc, loss = [r[0] for r in runs], [r[1] for r in runs]
        print(
            f"correlation with glue_dev across seeds: val accuracy {statistics.correlation(acc, glue):+.2f}, "
            f"val loss {statistics.correlation(loss, glue):+.2f}"
        )
    # Two searches that pick equally good configurations still differ by two such draws per seed.
    print(f"sd of a difference of two picks pooled over 3 seeds, from seeds alone: {sd * math.sqrt(2 / 3):.4f}")


def train_once(args: argparse.Namespace, train: Path, dev: Path, seed: int) -> tuple[float, float, float]:
    """Val accuracy, val loss and glue_dev accuracy of one Trainer run with training seed ``seed``."""
    import numpy as np
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    name = model_dir()
    tok = AutoTokenizer.from_pretrained(name)

    def encode(path: Path) -> list[dict[str, Any]]:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        enc = tok([r["text"] for r in rows], truncation=True, max_length=args.max_length)
        return [
            {"input_ids": ids, "attention_mask": mask, "labels": r["label"]}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
        ]

    def compute_metrics(pred: Any) -> dict[str, float]:
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    targs = TrainingArguments(
        output_dir=str(args.work_dir / f"run-{seed}"),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_ratio,  # transformers 5: below 1 is a ratio of the steps
        weight_decay=args.weight_decay,
        seed=seed,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=auto_precision() == "bf16",
    )
    trainer = Trainer(
        model_init=lambda: AutoModelForSequenceClassification.from_pretrained(name, num_labels=2),
        args=targs,
        train_dataset=encode(train),
        eval_dataset=encode(dev),
        processing_class=tok,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    scores = trainer.evaluate()
    correct = score_glue_dev(trainer.model, tok, read_tsv(args.data_dir / "glue_dev.tsv"), args.max_length)
    return scores["eval_accuracy"], scores["eval_loss"], sum(correct) / len(correct)


if __name__ == "__main__":
    main()
