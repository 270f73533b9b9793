"""Sharded against data-parallel trials on this CPU (issue 40), and the memory plan against what a trial uses.

    python benchmarks/sharding.py                    # 2 gloo ranks, 3 model sizes, 1 torch thread a rank
    python benchmarks/sharding.py --steps 8 --threads 2

1. One GPT-2 (8 layers, 512 wide) trained for ``--steps`` optimizer steps by hpsearch's ``fit`` over 2 real gloo
   ranks, with ``sharding = "none"`` (DDP) and ``"fsdp"``: per rank, the parameters + AdamW moments it held (measured
   from its tensors: its shards under fsdp), its peak resident memory while training (sampled every 5 ms, with
   glibc told to return freed tensor memory: see main(); it includes the torch runtime, ~0.3 GB), and the time a
   step took; and the fsdp / none ratios.
2. The memory plan (trainer/memory.py, from the config on the meta device) against one process's measured peak for
   3 sizes: weights + gradients + optimizer against the tensors it held after a step, and the plan's total against
   the peak resident memory above what the process held before the model was made.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

SIZES = {"small": (4, 256), "medium": (8, 512), "large": (12, 768)}  # (layers, hidden)
COMPARED = "large"  # parameters and moments (1.3 GB) outweigh its activations: what sharding is for


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class PeakRss:
    """The process's peak resident memory while running, sampled on a thread (ru_maxrss is a lifetime peak)."""

    def __init__(self) -> None:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _model(work: Path, size: str) -> str:
    from hpsearch.search.presets import tiny_gpt2

    layers, hidden = SIZES[size]
    folder = work / f"gpt2-{size}"
    if not folder.exists():
        tiny_gpt2.build(folder, layers=layers, hidden=hidden, heads=8, dropout=0.0)
    return str(folder)


def _data(work: Path) -> tuple[str, str]:
    from hpsearch.search.presets import tiny_gpt2

    for name, n, seed in (("train", 512, 1), ("dev", 64, 2)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in tiny_gpt2.texts(n, seed)))
    return str(work / "train.jsonl"), str(work / "dev.jsonl")


def _config(args: argparse.Namespace, sharding: str, devices: int) -> Any:
    from hpsearch.trainer.config import TrainConfig

    cfg = TrainConfig(learning_rate=1e-3, batch_size=16, micro_batch_size=4, max_steps=args.steps, precision="fp32")
    return replace(cfg, eval_every=args.steps, sharding=sharding, devices_per_trial=devices, resume_every_minutes=1e6)


def _train(model_dir: str, files: tuple[str, str], cfg: Any, out: Path, world: Any) -> dict[str, Any]:
    import torch

    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer import meta_model
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    data = prepare(DataConfig(train=files[0], validation=files[1]), tokenizer, 64, None, task="causal-lm")
    before = _rss()
    with PeakRss() as rss:
        # One copy, read from disk (a worker's cache would hold a pristine one beside it, for its next trial);
        # a sharded trial's other ranks build it empty, as search/workers/ranks.py does, and receive their shards.
        if cfg.sharding == "fsdp" and world.rank > 0:
            model = meta_model.empty_model(model_dir, None, None)
        else:
            model = load_model(model_dir, 0)
        files_out = RunFiles(out / "best", out / "resume/state.pt", out / "tensorboard", out / "resume/oom.json")
        run = Run(model, tokenizer, data, cfg, "loss", torch.device("cpu"), files_out, world=world)
        started = time.perf_counter()
        result = fit(run, NullReporter())
        seconds = time.perf_counter() - started
    return {
        "peak_mb": rss.peak / 2**20,
        "above_mb": (rss.peak - before) / 2**20,
        "step_s": seconds / result.steps,
        "held_mb": (result.figures.rank_held_mb or [None])[world.rank],
    }


def _rank(rank: int, port: int, model_dir: str, files: tuple[str, str], cfg: Any, out: str, threads: int) -> None:
    import torch

    from hpsearch.trainer import distributed

    torch.set_num_threads(threads)
    world = distributed.join(rank, 2, port, torch.device("cpu"))
    try:
        figures = _train(model_dir, files, cfg, Path(out) / f"r{rank}", world)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        world.close()


def two_ranks(args: argparse.Namespace, model_dir: str, files: tuple[str, str], sharding: str, out: Path) -> list[dict]:
    from hpsearch.trainer import distributed

    store = distributed.main_store(2)
    ctx = mp.get_context("spawn")
    cfg = _config(args, sharding, 2)
    ranks = [
        ctx.Process(target=_rank, args=(r, store.port, model_dir, files, cfg, str(out), args.threads)) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
        assert p.exitcode == 0, f"a rank failed ({p.exitcode})"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _one(model_dir: str, files: tuple[str, str], cfg: Any, out: str, threads: int) -> None:
    import torch

    from hpsearch.trainer import held
    from hpsearch.trainer.distributed import World

    torch.set_num_threads(threads)
    figures = _train(model_dir, files, cfg, Path(out), World())
    # The tensors one device holds after a step: parameters, gradients and moments of a fresh run of one step.
    from hpsearch.trainer.model import PretrainedCache

    model = PretrainedCache().fresh_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 500, (cfg.micro_batch_size, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    mine = held.held_bytes(model, optimizer)
    figures["tensors_mb"] = sum(mine.values()) / 2**20
    (Path(out) / "one.json").write_text(json.dumps(figures))


def planned(model_dir: str, cfg: Any) -> Any:
    from hpsearch.trainer import memory, meta_model

    meta, shape = meta_model.meta_model(model_dir, "causal-lm")
    setup = memory.Setup("fp32", cfg.micro_batch_size, 64, sharding=cfg.sharding, devices=cfg.devices_per_trial)
    return memory.estimate(meta, shape, setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The ranks are spawned: they start with these. glibc otherwise keeps freed tensor memory (its mmap threshold
    # rises to the largest block freed, and later blocks of that size come from the heap, never returned), and
    # the resident peak measures what the allocator hoards, not what the run holds: FSDP's gathered blocks and
    # unsharded gradients, freed after each use, read as 1.3x DDP's peak without these and 0.6x with them.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = _data(work)
        models = {size: _model(work, size) for size in SIZES}
        print(f"2 gloo ranks, GPT-2 {COMPARED} {SIZES[COMPARED]}, {args.steps} steps of 16 x 64 tokens, fp32")
        print(f"{'sharding':<9}{'rank':>5}{'held MB':>10}{'peak RSS MB':>13}{'step s':>9}")
        runs = {}
        for strategy in ("none", "fsdp"):
            runs[strategy] = two_ranks(args, models[COMPARED], files, strategy, work / strategy)
            for r, f in enumerate(runs[strategy]):
                print(f"{strategy:<9}{r:>5}{f['held_mb']:>10.1f}{f['peak_mb']:>13.0f}{f['step_s']:>9.3f}")
        for key, what in (("held_mb", "held"), ("peak_mb", "peak RSS"), ("step_s", "step time")):
            ratio = max(f[key] for f in runs["fsdp"]) / max(f[key] for f in runs["none"])
            print(f"fsdp / none, {what}: {ratio:.2f}")
        print("\nmemory plan against one process (sharding none), per size")
        print(
            f"{'size':<8}{'params':>10}{'plan w+g+o MB':>15}{'tensors MB':>12}{'plan total MB':>15}{'measured MB':>13}"
        )
        for size, model_dir in models.items():
            cfg = _config(args, "none", 1)
            out = work / f"one-{size}"
            out.mkdir()
            p = mp.get_context("spawn").Process(target=_one, args=(model_dir, files, cfg, str(out), args.threads))
            p.start()
            p.join()
            f = json.loads((out / "one.json").read_text())
            e = planned(model_dir, cfg)
            states = (e.weights + e.gradients + e.optimizer) / 2**20
            print(
                f"{size:<8}{e.parameters / 1e6:>9.1f}M{states:>15.1f}{f['tensors_mb']:>12.1f}"
                f"{e.total / 2**20:>15.1f}{f['above_mb']:>13.1f}"
            )


if __name__ == "__main__":
    main()
