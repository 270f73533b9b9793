"""Which validation point's model a trial should keep, judged on glue_dev.

hpsearch keeps, per trial, the model of its best validation point (among equal ones, the one
with the lowest validation loss). With a few hundred validation sentences that point is partly picked on noise, and the
last point, trained through the whole decaying schedule, could generalise better. This script
trains fixed configurations with hpsearch's own trainer on search_vs_hf's subsets (same seeds,
same sizes), scores the model at every validation point on glue_dev.tsv, and compares the
glue_dev accuracy each rule would have kept:

- best: the point with the best validation accuracy, a tie going to the lower validation loss
  (what the trainer keeps: read from its result, not recomputed here);
- best, earliest of equals: the same, but a tie goes to the earlier point (the trainer's rule
  before 2026-12-02);
- final: the last point, as HF's Trainer keeps.

Run by hand (about 2 minutes per configuration on 2 cores):

    python benchmarks/checkpoint_choice.py --seed 0 1 2
    python benchmarks/checkpoint_choice.py --seed 2 --config 1.9e-4 0.03 0.05
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import search_vs_hf as bench
import torch

from hpsearch.search.study.spec import load_file
from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.storage.trialdir import BEST, CURVES, OUT_OF_MEMORY_FILE, RESUME, RESUME_FILE
from hpsearch.trainer.checkpoint import RunFiles
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import Run, fit
from hpsearch.trainer.model import PretrainedCache, load_tokenizer

# Learning rate, warm-up ratio, weight decay: the region both searches of search_vs_hf end in.
CONFIGS = [(8.5e-5, 0.1, 0.05), (2e-4, 0.1, 0.05), (4e-4, 0.1, 0.05)]
RULES = ("best", "best, earliest of equals", "final")
CPU = torch.device("cpu")


class PointScorer(NullReporter):
    """Records, at every validation point, the validation accuracy and the glue_dev score of
    the model as it is at that point (the trainer reports right after validating)."""

    def __init__(self, model: Any, tok: Any, rows: list[dict[str, Any]], max_length: int) -> None:
        super().__init__()
        self.model, self.tok, self.rows, self.max_length = model, tok, rows, max_length
        self.glue: dict[int, float] = {}

    def report(self, value: float, step: int, metrics: object = None) -> None:
        super().report(value, step)
        correct = bench.score_glue_dev(self.model, self.tok, self.rows, self.max_length)
        self.glue[step] = sum(correct) / len(correct)


def kept_step(values: dict[int, float], rule: str, trainer_best: int) -> int:
    steps = sorted(values)
    if rule == "best":
        return trainer_best
    if rule == "best, earliest of equals":
        top = max(values.values())
        return next(s for s in steps if values[s] == top)
    return steps[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=bench.ROOT.parent / "shared" / "data" / "sst2")
    p.add_argument("--train-size", type=int, default=1024)
    p.add_argument("--dev-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--evals-per-epoch", type=int, default=4, help="validation points per epoch")
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument(
        "--config",
        type=float,
        nargs=3,
        action="append",
        metavar=("LR", "WARMUP", "DECAY"),
        help=f"a configuration to train (repeatable); default: {CONFIGS}",
    )
    p.add_argument("--work-dir", type=Path, default=bench.ROOT / "benchmarks" / ".checkpoint_choice")
    args = p.parse_args()
    configs = [tuple(c) for c in args.config] if args.config else CONFIGS

    shutil.rmtree(args.work_dir, ignore_errors=True)
    glue_rows = bench.read_tsv(args.data_dir / "glue_dev.tsv")
    kept: dict[str, list[float]] = {rule: [] for rule in RULES}
    ties = 0
    print(f"{'seed':>4} {'lr':>8} {'warmup':>6} {'decay':>6}  " + "  ".join(f"{r:>22}" for r in RULES))
    for seed in args.seed:
        work_dir = args.work_dir / f"seed-{seed}"
        work_dir.mkdir(parents=True)
        # search_vs_hf's own settings, with its default sampler and space (write_spec reads them).
        extra = {"seed": seed, "work_dir": work_dir, "n_trials": len(configs), "sampler": None, "space": "issue"}
        run = argparse.Namespace(**{**vars(args), **extra})
        train, dev = bench.subsets(run)
        # search_vs_hf's own spec: the same training settings as the benchmark's trials.
        spec = load_file(bench.write_spec(run, train, dev))
        tok = load_tokenizer(spec.model.name)
        data = prepare(spec.data, tok, spec.model.max_length, None, task=spec.model.task)
        for i, (lr, warmup, decay) in enumerate(configs):
            cfg = replace(spec.train, learning_rate=lr, warmup_ratio=warmup, weight_decay=decay)
            model = PretrainedCache().trial_model(spec.model.name, data.labels, cfg.seed)
            scorer = PointScorer(model, tok, glue_rows, args.max_length)
            out = work_dir / f"config-{i}"
            run_ = Run(
                model=model,
                tokenizer=tok,
                data=data,
                cfg=cfg,
                metric="accuracy",
                device=CPU,
                files=RunFiles(out / BEST, out / RESUME / RESUME_FILE, out / CURVES, out / RESUME / OUT_OF_MEMORY_FILE),
            )
            result = fit(run_, scorer)
            assert result.best_step is not None
            steps = {rule: kept_step(scorer.values, rule, result.best_step) for rule in RULES}
            ties += steps["best"] != steps["best, earliest of equals"]
            for rule, step in steps.items():
                kept[rule].append(scorer.glue[step])
            print(
                f"{seed:>4} {lr:>8.2g} {warmup:>6.2f} {decay:>6.2f}  "
                + "  ".join(f"{scorer.glue[s]:>13.4f} @ {s:>5}" for s in steps.values()),
                flush=True,
            )
            curve = " ".join(f"{s}:{scorer.values[s]:.3f}/{scorer.glue[s]:.3f}" for s in sorted(scorer.values))
            print(f"      validation/glue_dev by step: {curve}", flush=True)
    n = len(kept["best"])
    print(f"\nmean glue_dev over {n} runs (a tie at the best point broken by the loss in {ties}):")
    for rule in RULES:
        print(f"  {rule:>22}: {sum(kept[rule]) / n:.4f}")


if __name__ == "__main__":
    main()
