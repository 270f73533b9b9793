"""Held-out accuracy of one configuration under hpsearch's length grouping, over training seeds (issue 60).

The fifth pass of issue 41 (benchmarks/history.md) measured it by hand: one configuration (seed 2's pick of
search_vs_hf: lr 3.52e-4, warm-up 0.0775, weight decay 0.0905) as a four-trial study, a grid over ``train.seed`` 0-3,
no pruning, on search_vs_hf's seed-2 subsets (2,048 SST-2 rows, 256 to validate), each trial's best model scored
on glue_dev (872 sentences). Windows of 4 steps, one micro-batch a step: 0.7916 (0.8005 0.7936 0.7833 0.7890).
This script repeats it for any micro-batch, so the dealt micro-batches (two or more a step) are measured the same
way. Run by hand:

    python benchmarks/batching_accuracy.py --data-dir ../shared/data/sst2 --threads 1 --micro-batch-size 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import describe_machine
from search_vs_hf import glue_dev_correct, model_dir, subsets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--dev-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=2, help="the subsets' draw (search_vs_hf's --seed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = Path(tmp)
        train, dev = subsets(args)
        spec = args.work_dir / "spec.toml"
        spec.write_text(f"""
[model]
name = "{model_dir()}"
max_length = {args.max_length}
[data]
train = "{train}"
validation = "{dev}"
[train]
learning_rate = 3.52e-4
warmup_ratio = 0.0775
weight_decay = 0.0905
batch_size = {args.batch_size}
micro_batch_size = {args.micro_batch_size}
epochs = 1
eval_every = 64
[search]
n_trials = {len(args.train_seeds)}
sampler = "grid"
pruner = "none"
metric = "accuracy"
keep_top_k = {len(args.train_seeds)}
[search.space]
seed = {{ type = "categorical", choices = {args.train_seeds} }}
""")
        url = f"sqlite:///{args.work_dir / 'db.sqlite'}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "hpsearch.search.cli.main", "start", "--study", "batching", "--config", str(spec)]
        cmd += ["--storage", url, "--devices", "cpu:1", "--output-dir", str(args.work_dir / "runs")]
        subprocess.run(cmd, check=True, env=env, cwd=args.work_dir, stdout=subprocess.DEVNULL)
        import optuna

        scores = {}
        for trial in optuna.load_study(study_name="batching", storage=url).trials:
            correct = glue_dev_correct(Path(trial.user_attrs["best_checkpoint"]), args)
            scores[trial.params["seed"]] = sum(correct) / len(correct)
    print(f"micro-batch {args.micro_batch_size} of batch {args.batch_size}, subsets seed {args.seed}")
    for seed, acc in sorted(scores.items()):
        print(f"  train seed {seed}: glue_dev {acc:.4f}")
    values = list(scores.values())
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    print(f"glue_dev mean {statistics.mean(values):.4f}, sd {sd:.4f} (4-step windows, micro 32: 0.7916)")


if __name__ == "__main__":
    main()
