"""What the token cache costs a worker (issue 58, item 5): SST-2's training sentences repeated to N rows, tokenised
once into the cache (``prepare`` with a cold cache, in its own process: rows per second and that process's peak
resident memory), then a worker's share: a fresh process that imports torch, opens the cache (``prepare``, a hit)
and builds one epoch of padded batches as the loop does (``micro_batches`` with length grouping, then ``collate``
on every micro-batch), its peak resident memory (VmHWM) and its private (anonymous) memory at the end.

    python benchmarks/token_cache.py --data-dir ../shared/data/sst2 --rows 100000 1000000

``--code DIR`` runs another checkout's trainer (say, main's before the Arrow cache: ``git archive <commit> search
trainer storage | tar -x -C DIR``): DIR's folders are put first on the import path as ``hpsearch.*``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_LENGTH, MICRO, BATCH = 64, 32, 32


def memory_mib() -> dict[str, float]:
    """Peak resident memory (VmHWM: file pages mapped and touched count too) and the private part now (RssAnon)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def use_code(code: str) -> None:
    """Import ``hpsearch.*`` from another checkout: a package folder whose subpackages are that checkout's."""
    if not code:
        return
    import importlib.util
    import types

    root = Path(code).resolve()
    package = types.ModuleType("hpsearch")
    package.__path__ = [str(root / "search" / "api")]
    sys.modules["hpsearch"] = package
    for name in ("search", "trainer", "storage"):
        spec = importlib.util.spec_from_file_location(
            f"hpsearch.{name}", root / name / "__init__.py", submodule_search_locations=[str(root / name)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"hpsearch.{name}"] = module
        spec.loader.exec_module(module)


def tokenise(args: argparse.Namespace) -> None:
    """In its own process: a cold cache, tokenised and written once."""
    use_code(args.code)
    from transformers import AutoTokenizer

    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.encoding import prepare

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = DataConfig(train=args.train, validation=args.dev, text_column="sentence")
    started = time.perf_counter()
    prepared = prepare(cfg, tokenizer, MAX_LENGTH, Path(args.cache))
    seconds = time.perf_counter() - started
    rows = len(prepared.train) + len(prepared.validation)
    print(json.dumps({"seconds": seconds, "rows_per_s": rows / seconds, **memory_mib()}))


def worker(args: argparse.Namespace) -> None:
    """In its own process: what a worker holds once it has the data and runs an epoch of batches."""
    use_code(args.code)
    import torch
    from transformers import AutoTokenizer

    from hpsearch.trainer.batching import collate, micro_batches
    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.encoding import prepare

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = DataConfig(train=args.train, validation=args.dev, text_column="sentence")
    before = memory_mib()["VmHWM"]
    started = time.perf_counter()
    prepared = prepare(cfg, tokenizer, MAX_LENGTH, Path(args.cache))
    opened = time.perf_counter() - started
    train = prepared.train
    batches = micro_batches(train.lengths, MICRO, seed=0, epoch=0, group_by_length=True, batch_size=BATCH)
    tokens = 0
    for indices in batches:
        tokens += int(collate(train, indices, prepared.pad_id)["attention_mask"].sum())
    seconds = time.perf_counter() - started
    result = {"open_s": opened, "epoch_s": seconds - opened, "batches": len(batches), "tokens": tokens}
    print(json.dumps({**result, "before_mib": before, **memory_mib()}))


def build_tokenizer(sentences: list[str], folder: Path) -> None:
    """A WordPiece tokenizer (8,000 pieces) trained on SST-2 itself: offline, and as fast as BERT's."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    trained = BertWordPieceTokenizer(lowercase=True)
    trained.train_from_iterator(sentences, vocab_size=8000, show_progress=False)
    BertTokenizerFast(tokenizer_object=trained._tokenizer).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--code", default="", help="another checkout whose trainer to measure (see above)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--phase", choices=("tokenise", "worker"), help=argparse.SUPPRESS)
    for hidden in ("--train", "--dev", "--cache", "--tokenizer"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "tokenise":
        tokenise(args)
        return
    if args.phase == "worker":
        worker(args)
        return
    with (args.data_dir / "train.tsv").open(newline="") as f:
        sst2 = [
            {"sentence": r["sentence"], "label": int(r["label"])}
            for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        ]
    print(
        "| code | rows | tokenise rows/s | tokenising peak RSS | worker peak RSS | worker private RSS | open | epoch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer([r["sentence"] for r in sst2], Path(tmp) / "tokenizer")
        dev = Path(tmp) / "dev.jsonl"
        dev.write_text("".join(json.dumps(r) + "\n" for r in sst2[:872]))
        for n in args.rows:
            train = Path(tmp) / f"train-{n}.jsonl"
            with train.open("w") as f:
                for i in range(n):
                    f.write(json.dumps(sst2[i % len(sst2)]) + "\n")
            common = ["--train", str(train), "--dev", str(dev), "--cache", str(Path(tmp) / f"cache-{n}")]
            common += ["--tokenizer", str(Path(tmp) / "tokenizer"), "--code", args.code]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            results = {}
            for phase in ("tokenise", "worker"):
                done = subprocess.run(
                    [sys.executable, __file__, "--phase", phase, *common], capture_output=True, text=True, env=env
                )
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                results[phase] = json.loads(done.stdout.strip().splitlines()[-1])
            t, w = results["tokenise"], results["worker"]
            print(
                f"| {args.label} | {n:,} | {t['rows_per_s']:,.0f} | {t['VmHWM']:,.0f} MiB | {w['VmHWM']:,.0f} MiB "
                f"(before the data: {w['before_mib']:,.0f}) | {w['RssAnon']:,.0f} MiB | {w['open_s']:.1f} s | "
                f"{w['epoch_s']:.1f} s ({w['batches']:,} batches) |",
                flush=True,
            )
            train.unlink()


if __name__ == "__main__":
    main()
