"""search_vs_hf in seconds: hpsearch's sampler and pruner against HF's search on a simulated landscape.

One real run of ``search_vs_hf.py`` is one draw: with 12 trials, which learning rates the
first trials happen to draw decides the result, so a single seed cannot tell a better default
from a lucky one. This script replays both searches over hundreds of seeds on a surrogate of
the landscape those runs measured (MiniLM, SST-2, 1024 examples, 2 epochs, 128 optimizer steps,
validation every 16):

- final validation accuracy peaks at ~0.835 for learning rates 1e-4..2e-4 and falls off on a
  log scale (2e-5 -> ~0.75, 7e-4 -> ~0.77, 1e-6 -> chance);
- higher learning rates learn faster early (the short-horizon bias that rung decisions see);
- the validation loss leaves the label prior's entropy as soon as anything is learnt, well before
  accuracy moves (what patient pruning reads: a falling loss at chance accuracy is not judged early);
- a trial in its warm-up learns from the learning rate summed so far, so its first points sit
  near the majority share (seen on seeds 2 and 5 of the real runs);
- each validation point has noise (256 examples: sd ~0.02) and the held-out score of a trial
  differs from its validation score by a trial-specific amount (sd ~0.012);
- every point scores the same rows, so the loss's noise is mostly which rows those are, a constant of the trial
  (sd 0.01), plus a little that training moves between two points (sd 0.002; measured on SST-2, a learning rate
  too low to learn moved the loss 0.0001-0.0003 between steps 1 and 5: benchmarks/history.md). ``--loss-noise iid``
  draws it afresh at every point instead (sd 0.01), the pessimistic bound.

The sampler and pruner are hpsearch's own (``make_sampler``/``make_pruner`` from a spec), with the
trainer's chance stop (``search.prune_at_chance``, on accuracy alone), so the script follows the
defaults as they change; ``--pruner``/``--reduction-factor``/... try others.
HF's side is ``TPESampler(seed)`` with every trial run to the end. As in the real benchmark, the
two sides draw from different seeds: optuna's TPE starts with the draws of ``RandomSampler(seed)``,
so with one seed for both the first trials would be the same and the comparison far too kind.
The last line is a bound: hpsearch's sampler with a pruner that knows each trial's final
accuracy. Numbers are from the surrogate, not a measurement: use it to choose what to run for real.

    python benchmarks/search_sim.py --seeds 200
    python benchmarks/search_sim.py --seeds 200 --pruner median --sampler random
    python benchmarks/search_sim.py --seeds 1000 --sampler qmc
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import warnings
from types import SimpleNamespace

import numpy as np
import optuna

from hpsearch.search.study import sampling
from hpsearch.search.study.search_config import PRUNERS, SAMPLERS
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers import early_stop
from hpsearch.search.workers.early_stop import ChanceLevel, PruningGate
from hpsearch.trainer.config import TrainConfig
from hpsearch.trainer.evaluate import Metrics

STEPS, EVAL_EVERY, BATCH = 128, 16, 16  # --steps and --batch-size change them (the run: 64 steps of 32)
IID_LOSS_NOISE = False  # --loss-noise iid
# Balanced labels, 256 validation examples.
PRIOR = ChanceLevel.of([0, 1] * 128)
assert PRIOR is not None


def final_accuracy(lr: float, warmup: float) -> float:
    return max(0.55, 0.835 - 0.13 * (math.log10(lr) + 3.9) ** 2 - 0.02 * (warmup - 0.15) ** 2)


def run_trial(
    params: dict[str, float], rng: random.Random, early: frozenset[int] = frozenset()
) -> tuple[dict[int, tuple[float, float]], float]:
    """Validation accuracy and loss at each validation step (the early points' too), and the held-out score of the
    trained model."""
    lr, warmup = params["learning_rate"], params["warmup_ratio"]
    final = final_accuracy(lr, warmup)
    speed = 0.027 * (lr / 8.45e-5) ** 0.77
    offset, held_out = rng.gauss(0, 0.01), final - 0.05 + rng.gauss(0, 0.012)
    rows = 0.0 if IID_LOSS_NOISE else rng.gauss(0, 0.01)  # the scored rows' draw: the same at every point
    ramp = warmup * STEPS
    points = {}
    for step in sorted({*early, *range(EVAL_EVERY, STEPS + 1, EVAL_EVERY), STEPS}):
        # What the model has learnt grows with the learning rate summed so far, in units of
        # its peak: under a linear warm-up that sum is quadratic, so a warming-up trial's first
        # points sit near the majority share, as the real runs show.
        effective = step * step / (2 * ramp) if step < ramp else step - 0.5 * ramp
        mean = 0.5 + (final - 0.5) * (1 - math.exp(-effective * speed))
        learned = 1 - math.exp(-effective * speed)
        # The loss leaves the prior's entropy as soon as anything is learnt (seen on the real curves: it moves well
        # before accuracy does); a learning rate that learns nothing wobbles around it.
        loss = PRIOR.loss - 0.35 * learned + rows + rng.gauss(0, 0.01 if IID_LOSS_NOISE else 0.002)
        points[step] = (min(1.0, mean + offset + rng.gauss(0, 0.02)), loss)
    return points, held_out


class OraclePruner(optuna.pruners.BasePruner):
    """At the first point it is asked about, prunes every trial whose true final accuracy is more
    than 0.01 below the best seen so far: what a perfect predictor of learning curves would do."""

    def __init__(self) -> None:
        self.best = 0.0
        self.judged: set[int] = set()

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if trial.number in self.judged:
            return False
        self.judged.add(trial.number)
        final = final_accuracy(trial.params["learning_rate"], trial.params["warmup_ratio"])
        self.best = max(self.best, final)
        return final < self.best - 0.01


def search(
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
    spec: StudySpec,
    seed: int,
    *,
    prune_at_chance: int = 0,
    patient: bool = False,
    early: frozenset[int] = frozenset(),
) -> tuple[float, int, bool]:
    """One search; returns the held-out score of its best finished trial, the samples trained, and whether an early
    point pruned the trial that would have been best (the highest final accuracy of those it drew).

    ``seed`` also seeds the validation noise; the two sides pass different seeds.
    ``prune_at_chance`` is the trainer's chance stop (search.prune_at_chance), judged on
    accuracy and on the surrogate's loss.
    ``patient`` asks the pruner nothing during a trial's warm-up (search.patient_pruning); the
    bound's oracle knows the final accuracy and needs no such wait."""
    rng = random.Random(seed * 7 + 1)
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    best, held_out, samples = -1.0, float("nan"), 0
    top_final, top_cut_early = -1.0, False
    for _ in range(spec.search.n_trials):
        trial = study.ask()
        params = sampling.suggest(trial, spec)
        points, score = run_trial(params, rng, early)
        # The trainer's own judge, on the surrogate's accuracy and loss.
        warmup = round(params["warmup_ratio"] * STEPS)
        judge = PruningGate(
            PRIOR, warmup, STEPS, "accuracy", prune_at_chance=prune_at_chance, patient=patient, early=early
        )
        top, pruned, step = -1.0, False, 0
        for step, (value, loss) in points.items():
            top = max(top, value)
            trial.report(value, step)
            metrics = Metrics(loss=loss, accuracy=value)
            judge.see(step, metrics)
            early_cut = judge.cut_early(step, metrics)  # as EarlyStop.should_prune asks
            if early_cut is None:
                early_cut = judge.stuck or (judge.may_prune(step, metrics) and trial.should_prune())
            if early_cut:
                pruned = True
                break
        samples += step * BATCH
        final = final_accuracy(params["learning_rate"], params["warmup_ratio"])
        if final > top_final:
            top_final, top_cut_early = final, pruned and step in early
        if pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, top)
            if top > best:
                best, held_out = top, score
    return held_out, samples, top_cut_early


def main() -> None:
    global STEPS, BATCH, IID_LOSS_NOISE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--n-trials", type=int, default=12)
    p.add_argument("--sampler", choices=SAMPLERS, default=None, help="default: hpsearch's")
    p.add_argument("--pruner", choices=PRUNERS, default=None, help="default: hpsearch's")
    p.add_argument("--reduction-factor", type=int, default=None)
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps a trial")
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--no-early-points", action="store_true", help="search.early_points = false")
    p.add_argument(
        "--loss-noise",
        choices=("rows", "iid"),
        default="rows",
        help="rows: the scored rows' draw is a constant of the trial (the default); iid: fresh at every point",
    )
    p.add_argument("--min-resource", type=int, default=None)
    p.add_argument("--prune-at-chance", type=int, default=None, help="default: hpsearch's (0 = off)")
    p.add_argument(
        "--impatient",
        action="store_true",
        help="ask the pruner at every point (search.patient_pruning = false)",
    )
    args = p.parse_args()
    STEPS, BATCH, IID_LOSS_NOISE = args.steps, args.batch_size, args.loss_noise == "iid"
    warnings.filterwarnings("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    search_raw: dict[str, object] = {"n_trials": args.n_trials, "metric": "accuracy"}
    for key, value in (
        ("sampler", args.sampler),
        ("pruner", args.pruner),
        ("pruner_reduction_factor", args.reduction_factor),
        ("pruner_min_resource", args.min_resource),
        ("prune_at_chance", args.prune_at_chance),
        ("patient_pruning", False if args.impatient else None),
        ("early_points", False if args.no_early_points else None),
    ):
        if value is not None:
            search_raw[key] = value
    search_raw["space"] = {
        "learning_rate": {"type": "float", "low": 1e-6, "high": 1e-3, "log": True},
        "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.3},
        "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
    }
    spec = StudySpec.from_dict(
        {
            "model": {"name": "minilm"},
            "data": {"train": "train.jsonl", "validation": "dev.jsonl"},
            "train": {"batch_size": BATCH, "micro_batch_size": BATCH, "eval_every": EVAL_EVERY},
            "search": search_raw,
        }
    )
    full = args.n_trials * STEPS * BATCH
    # Each simulated search is the benchmark's study with search.seed = that seed, and the
    # sampler a single worker would build from it (its own seed derived as the worker does).
    specs = [
        dataclasses.replace(spec, search=dataclasses.replace(spec.search, seed=seed)) for seed in range(args.seeds)
    ]
    seeds = [sampling.worker_seed(sp, "cpu:0", 0) for sp in specs]
    # What a trial of the benchmark's shape is told to validate at (256 validation rows, all scored).
    shape = SimpleNamespace(train=range(STEPS * BATCH), validation=range(256))
    cfg = TrainConfig(batch_size=BATCH, micro_batch_size=BATCH, epochs=1, eval_every=EVAL_EVERY)
    early = early_stop.early_points(spec, cfg, shape).steps  # type: ignore[arg-type]
    chance = spec.search.prune_at_chance if spec.search.pruner != "none" else 0
    ours = [
        search(
            sampling.make_sampler(sp, s),
            sampling.make_pruner(sp),
            sp,
            s,
            prune_at_chance=chance,
            patient=spec.search.patient_pruning,
            early=early,
        )
        for sp, s in zip(specs, seeds, strict=True)
    ]
    bound = [search(sampling.make_sampler(sp, s), OraclePruner(), sp, s) for sp, s in zip(specs, seeds, strict=True)]
    hf = [
        search(optuna.samplers.TPESampler(seed=seed), optuna.pruners.NopPruner(), spec, seed)
        for seed in range(args.seeds)
    ]
    s = spec.search
    print(
        f"{args.seeds} seeds, {args.n_trials} trials: hpsearch {s.sampler} + {s.pruner} "
        f"(reduction factor {s.pruner_reduction_factor}, first rung {s.pruner_min_resource or EVAL_EVERY}, "
        f"{'waits for' if s.patient_pruning else 'judges during'} a trial's warm-up), "
        f"{STEPS} steps of {BATCH}, validation every {EVAL_EVERY}, early points at {sorted(early) or 'none'}"
    )
    print(f"{'':10}{'held-out mean':>14}{'p10':>8}{'samples':>9}{'samples > 0.5':>15}")
    for name, runs in (("hpsearch", ours), ("hf", hf), ("bound", bound)):
        score, samples = np.array([r[0] for r in runs]), np.array([r[1] for r in runs]) / full
        print(
            f"{name:10}{np.nanmean(score):>14.4f}{np.nanpercentile(score, 10):>8.4f}"
            f"{samples.mean():>9.3f}{(samples > 0.5).mean():>15.2f}"
        )
    for name, runs in (("hpsearch", ours), ("bound", bound)):
        as_good = np.mean([a[0] >= b[0] - 0.005 for a, b in zip(runs, hf, strict=True)])
        wins = np.mean([a[0] >= b[0] - 0.005 and a[1] <= full / 3 for a, b in zip(runs, hf, strict=True)])
        print(f"seeds where {name} meets the target (held-out >= hf - 0.005, samples <= 1/3): {wins:.2f}")
        print(f"seeds where {name}'s held-out is within half a point of hf's or above: {as_good:.2f}")
    cut = np.mean([r[2] for r in ours])
    print(f"searches where an early point pruned the trial that would have been best: {cut:.3f} (target < 0.05)")


if __name__ == "__main__":
    main()
