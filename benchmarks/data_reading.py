"""What reading a big training file costs (issue 58): SST-2's training sentences repeated to N rows, written as
Parquet, JSON lines and gzipped JSON lines, each read and split (``validation_fraction``) by ``read_splits`` in a
fresh process: wall time, rows per second and the process's peak resident memory.

    python benchmarks/data_reading.py --data-dir ../shared/data/sst2 --rows 100000 1000000
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("parquet", "jsonl", "jsonl.gz")


def write(path: Path, rows: list[dict[str, object]]) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM, which a new program starts afresh (getrusage's ru_maxrss keeps
    the parent's peak across fork and exec, here the parent's rows)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: str, fraction: float) -> None:
    """In its own process: the peak RSS is this read's alone (and the imports', given as "before")."""
    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.splits import read_splits

    before = peak_rss_mib()
    started = time.perf_counter()
    splits = read_splits(DataConfig(train=path, text_column="sentence", validation_fraction=fraction))
    seconds = time.perf_counter() - started
    peak = peak_rss_mib()
    rows = len(splits.train.texts) + len(splits.validation.texts)
    print(json.dumps({"seconds": seconds, "rows_per_s": rows / seconds, "peak_mib": peak, "before_mib": before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/sst2"))
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--validation-fraction", type=float, default=0.01)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.validation_fraction)
        return
    with (args.data_dir / "train.tsv").open(newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        sst2 = [{"sentence": r["sentence"], "label": int(r["label"])} for r in reader]
    print("| rows | file | size | read + split | rows/s | peak RSS | RSS before reading |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.rows:
            rows = (sst2 * (n // len(sst2) + 1))[:n]
            for fmt in FORMATS:
                path = Path(tmp) / f"train-{n}.{fmt}"
                write(path, rows)
                command = [sys.executable, __file__, "--measure", str(path)]
                command += ["--validation-fraction", str(args.validation_fraction)]
                out = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                print(
                    f"| {n:,} | {fmt} | {path.stat().st_size / 1e6:.1f} MB | {out['seconds']:.1f} s | "
                    f"{out['rows_per_s']:,.0f} | {out['peak_mib']:.0f} MiB | {out['before_mib']:.0f} MiB |",
                    flush=True,
                )
                path.unlink()


if __name__ == "__main__":
    main()
