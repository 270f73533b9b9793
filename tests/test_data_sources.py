"""Data as users keep it (issue 58): every file format, gzipped or not, `datasets` folders, a hub id from a local
cache, nested columns and a held-out validation share; each read for real from files built here, and every bad source
refused in one line."""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsearch.search.presets import demo_data
from hpsearch.storage import attrs
from hpsearch.trainer.config import ConfigError, DataConfig
from hpsearch.trainer.encoding import _cache_key
from hpsearch.trainer.reading import DataError
from hpsearch.trainer.splits import read_splits
from tests.conftest import Cli, assert_refused, spec_text, start_study


def _rows(n: int, seed: int) -> list[dict[str, Any]]:
    return [{"text": r["text"], "label": r["label"]} for r in demo_data.generate(n, seed)]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` in the format ``path``'s name says, gzipped where it ends in .gz."""
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    fmt = Path(name).suffix
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    if fmt == ".parquet":
        pq.write_table(table, sink)
    elif fmt == ".arrow":
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        text = {
            ".jsonl": lambda: "".join(json.dumps(r) + "\n" for r in rows),
            ".json": lambda: json.dumps(rows, indent=1),
            ".csv": lambda: _delimited(rows, ","),
            ".tsv": lambda: _delimited(rows, "\t"),
        }[fmt]()
        sink.write(text.encode())
    data = sink.getvalue().to_pybytes()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _delimited(rows: list[dict[str, Any]], delimiter: str) -> str:
    out = io.StringIO()
    # TSV as GLUE writes it: no quoting (hpsearch reads .tsv with quoting off); CSV quotes what holds a comma.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    writer = csv.writer(out, delimiter=delimiter, quoting=quoting, lineterminator="\n")
    writer.writerows([list(rows[0]), *(list(r.values()) for r in rows)])
    return out.getvalue()


FORMATS = ["jsonl", "jsonl.gz", "json", "json.gz", "csv", "csv.gz", "tsv", "tsv.gz", "parquet", "parquet.gz"]


@pytest.mark.parametrize("fmt", [*FORMATS, "arrow", "arrow.gz"])
def test_every_format_reads_the_same_examples(tmp_path: Path, fmt: str) -> None:
    train, dev = _rows(40, 1), _rows(12, 2)
    cfg = DataConfig(
        train=str(_write(tmp_path / f"train.{fmt}", train)), validation=str(_write(tmp_path / f"dev.{fmt}", dev))
    )
    splits = read_splits(cfg)
    assert splits.train.texts == [r["text"] for r in train]
    assert splits.validation.labels == [r["label"] for r in dev]
    assert splits.labels is not None and splits.labels.names == ("negative", "positive")


def test_arrow_stream_as_datasets_writes_it(tmp_path: Path) -> None:
    """`datasets` writes the Arrow stream format (data-00000-of-00001.arrow), not the file format."""
    rows = _rows(20, 3)
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "t.arrow").write_bytes(sink.getvalue().to_pybytes())
    cfg = DataConfig(train=str(tmp_path / "t.arrow"), validation=str(tmp_path / "t.arrow"))
    assert read_splits(cfg).train.texts == [r["text"] for r in rows]


def test_odd_encodings_are_read(tmp_path: Path) -> None:
    """A BOM (Excel's "CSV UTF-8") and UTF-16 (Excel's "Unicode text", PowerShell's default) are read as text."""
    rows = [{"text": "café crème", "label": "pos"}, {"text": "naïve", "label": "neg"}]
    tsv = _delimited(rows, "\t")
    (tmp_path / "u16.tsv").write_bytes(codecs.BOM_UTF16_LE + tsv.encode("utf-16-le"))
    (tmp_path / "bom.csv").write_bytes(codecs.BOM_UTF8 + _delimited(rows, ",").encode())
    splits = read_splits(DataConfig(train=str(tmp_path / "u16.tsv"), validation=str(tmp_path / "bom.csv")))
    assert splits.train.texts == ["café crème", "naïve"] == splits.validation.texts


def test_nested_columns(tmp_path: Path) -> None:
    """``review.text`` reaches into an object in JSON lines and into a struct column in Parquet."""
    rows = [{"review": {"text": r["text"], "stars": 1}, "meta": {"y": [r["label"]]}} for r in _rows(30, 4)]
    jsonl, parquet = _write(tmp_path / "n.jsonl", rows), _write(tmp_path / "n.parquet", rows)
    cfg = DataConfig(train=str(jsonl), validation=str(parquet), text_column="review.text", label_column="meta.y.0")
    splits = read_splits(cfg)
    assert splits.train.texts == [r["review"]["text"] for r in rows] == splits.validation.texts
    assert splits.train.labels == [r["meta"]["y"][0] for r in rows]
    with pytest.raises(DataError, match=r"n\.jsonl: row at line 1 has no column 'review\.title' \(columns: review"):
        read_splits(DataConfig(train=str(jsonl), validation=str(jsonl), text_column="review.title", label_column="x"))


def _two_rows(text: Any, label: Any) -> Any:
    return lambda p: _write(p, [{"text": "fine", "label": "a"}, {"text": text, "label": label}])


XLSX = "unsupported format '.xlsx'; hpsearch reads .jsonl, .json, .csv, .tsv, .parquet or .arrow (each optionally .gz)"
BAD_SOURCES = [
    ("t.parquet", _two_rows(None, "b"), "row 2: 'text' must be text, got None"),
    ("t.parquet", lambda p: _write(p, [{"text": "a", "label": 1.5}]), "row 1: label 1.5 in column 'label' is a float"),
    ("t.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n{oops\n')), "line 2 is not valid JSON"),
    ("t.csv.gz", lambda p: p.write_bytes(b"text,label\na,1\n"), "is not whole gzip data"),
    ("t.json", lambda p: p.write_text('{"rows": 3}'), "row 1 has no column 'text'"),
    ("t.json", lambda p: p.write_text('[{"text": "a", "label": 1}, 7]'), "row 2 must be a JSON object, got 7"),
    ("t.arrow", lambda p: p.write_bytes(b"not arrow at all"), "cannot be read as Arrow"),
    ("t.xlsx", lambda p: p.write_bytes(b"PK"), XLSX),
    ("t.xlsx", lambda p: p.write_bytes(b"PK"), "pandas.read_excel('FILE').to_parquet('data.parquet')"),
    (
        "mixed",
        lambda p: (p.mkdir(), (p / "a.csv").write_text("x"), (p / "b.parquet").write_text("x")),
        "is a folder (it holds .csv, .parquet files)",
    ),
    (
        "saved",
        lambda p: (p.mkdir(), (p / "dataset_dict.json").write_text("{}")),
        "is a `datasets` save_to_disk folder; set data.dataset =",
    ),
]


@pytest.mark.parametrize(("name", "make", "expected"), BAD_SOURCES)
def test_bad_sources_are_one_line(tmp_path: Path, name: str, make: Any, expected: str) -> None:
    bad = tmp_path / name
    make(bad)
    good = _write(tmp_path / "good.jsonl", _rows(8, 5))
    with pytest.raises(DataError) as exc:
        read_splits(DataConfig(train=str(bad), validation=str(good)))
    assert expected in str(exc.value)
    assert str(bad) in str(exc.value) and "\n" not in str(exc.value)


def _saved_one(folder: Path) -> None:
    import datasets

    datasets.Dataset.from_list(_rows(8, 16)).save_to_disk(str(folder))


CLI_REFUSALS = [
    # (what [data] says, given a folder to build it in; the line expected)
    (lambda d: (d / "t.feather").write_bytes(b"x") and 'train = "t.feather"\nvalidation = "dev.jsonl"',
     "unsupported format '.feather'; hpsearch reads .jsonl, .json, .csv, .tsv, .parquet or .arrow (each optionally "
     ".gz), a `datasets` save_to_disk folder or a hub dataset id (data.dataset); a Feather (v2) file is an Arrow file"),
    (lambda d: (d / "t.parquet").write_bytes(b"PAR1 broken") and 'train = "t.parquet"\nvalidation = "dev.jsonl"',
     "cannot be read as Parquet"),
    (lambda d: _saved_one(d / "one") or 'train = "one"\nvalidation = "dev.jsonl"',
     "is a `datasets` save_to_disk folder; set data.dataset ="),
    (lambda d: _saved_one(d / "one") or 'dataset = "one"',
     "is one Dataset, without splits, so it holds no validation rows; set data.validation_fraction"),
    (lambda d: 'train = "dev.jsonl"\nvalidation = "dev.jsonl"\nvalidation_fraction = 0.2',
     "data.validation_fraction: 0.2 holds out training rows for validation, but data.validation names a file too"),
    (lambda d: 'train = "dev.jsonl"\nvalidation_fraction = 0.01', "validation_fraction 0.01 of its 8 rows leaves no"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "expected"), CLI_REFUSALS)
def test_bad_source_exits_2_in_one_line(cli: Cli, tmp_path: Path, tiny_model: Path, make: Any, expected: str) -> None:
    dev = _write(tmp_path / "dev.jsonl", _rows(8, 6))
    data = make(tmp_path)
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, dev, dev, n_trials=1)
    spec.write_text(text.replace(f'train = "{dev}"\nvalidation = "{dev}"', data))
    assert_refused(cli, spec, tmp_path, expected)


# ---- `datasets` folders and the hub ---------------------------------------------------------------------------------


def test_save_to_disk_dataset_dict_with_named_splits(tmp_path: Path) -> None:
    import datasets

    train, dev = _rows(30, 7), _rows(10, 8)
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"tr": datasets.Dataset.from_list(train), "dev": datasets.Dataset.from_list(dev)}
    ).save_to_disk(str(folder))
    splits = read_splits(DataConfig(dataset=str(folder), train_split="tr", validation_split="dev"))
    assert splits.train.texts == [r["text"] for r in train]
    assert splits.validation.texts == [r["text"] for r in dev]
    with pytest.raises(DataError, match=r"has no split 'validation' \(splits: tr, dev\); set data.validation_split"):
        read_splits(DataConfig(dataset=str(folder), train_split="tr"))


def test_single_saved_dataset_needs_a_validation_share(tmp_path: Path) -> None:
    import datasets

    rows = _rows(50, 9)
    folder = tmp_path / "one"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    with pytest.raises(DataError, match=r"is one Dataset, without splits.*set data\.validation_fraction"):
        read_splits(DataConfig(dataset=str(folder)))
    splits = read_splits(DataConfig(dataset=str(folder), validation_fraction=0.2))
    assert len(splits.train.texts) == 40 and len(splits.validation.texts) == 10
    assert sorted(splits.train.texts + splits.validation.texts) == sorted(r["text"] for r in rows)


def test_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    """A hub dataset id, read offline from a Hugging Face cache (built here with `datasets` itself, as a download
    would leave it), in a fresh process as a worker reads it."""
    train, dev = _write(tmp_path / "train.jsonl", _rows(24, 10)), _write(tmp_path / "dev.jsonl", _rows(8, 11))
    home = tmp_path / "hf-home"
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    # A download leaves HF_HOME/datasets/someone___reviews/default/0.0.0/HASH/reviews-{train,validation}.arrow:
    # built here by the same packaged builder a hub download of JSON files runs.
    build = (
        "import sys; from datasets.packaged_modules.json.json import Json; "
        "b = Json(data_files={'train': sys.argv[1], 'validation': sys.argv[2]}, dataset_name='reviews', "
        "hash='0123abcd', config_id='default'); b.repo_id = 'someone/reviews'; b._cache_dir = b._build_cache_dir(); "
        "b.download_and_prepare()"
    )
    subprocess.run([sys.executable, "-c", build, str(train), str(dev)], env=env, check=True, capture_output=True)
    read = (
        "from hpsearch.trainer.config import DataConfig; from hpsearch.trainer.splits import read_splits; "
        "s = read_splits(DataConfig(dataset='someone/reviews')); print(len(s.train.texts), len(s.validation.texts), "
        "s.validation.texts[0])"
    )
    out = subprocess.run([sys.executable, "-c", read], env=env, check=True, capture_output=True, text=True).stdout
    assert out.split(maxsplit=2) == ["24", "8", _rows(8, 11)[0]["text"] + "\n"]
    missing = read.replace("someone/reviews", "someone/absent")
    result = subprocess.run([sys.executable, "-c", missing], env=env, capture_output=True, text=True)
    assert "data.dataset someone/absent: not a folder here, and not readable as a hub dataset" in result.stderr


# ---- validation_fraction ------------------------------------------------------------------------------------------


def test_validation_fraction_is_stratified_and_seeded(tmp_path: Path) -> None:
    rows = [{"text": f"example {i}", "label": "rare" if i % 10 == 0 else "common"} for i in range(200)]
    train = _write(tmp_path / "train.csv", rows)
    cfg = DataConfig(train=str(train), validation_fraction=0.1)
    splits = read_splits(cfg)
    # Stratified: 10% of each class (2 of 20 rare, 18 of 180 common), not whatever a plain shuffle gives.
    assert Counter(splits.validation.labels) == {"common": 18, "rare": 2}
    assert len(splits.train.texts) == 180 and not set(splits.train.texts) & set(splits.validation.texts)
    again = read_splits(cfg)
    assert again.validation.texts == splits.validation.texts
    other = read_splits(DataConfig(train=str(train), validation_fraction=0.1, split_seed=1))
    assert other.validation.texts != splits.validation.texts
    # Which rows are held out is part of the token cache's identity: another seed, another cache.
    keys = {
        _cache_key(c, "tokenizer", 32, "classification") for c in (cfg, DataConfig(**{**vars(cfg), "split_seed": 1}))
    }
    assert len(keys) == 2


def test_validation_fraction_same_on_two_workers(tmp_path: Path) -> None:
    """Two processes (two workers, as on two hosts) hold out the very same rows."""
    train = _write(tmp_path / "train.parquet", _rows(300, 12))
    read = (
        "import sys; from hpsearch.trainer.config import DataConfig; "
        "from hpsearch.trainer.splits import read_splits; "
        "s = read_splits(DataConfig(train=sys.argv[1], validation_fraction=0.15, split_seed=7)); "
        "print('|'.join(s.validation.texts))"
    )
    seen = [
        subprocess.run([sys.executable, "-c", read, str(train)], check=True, capture_output=True, text=True).stdout
        for _ in range(2)
    ]
    assert seen[0] == seen[1] and len(seen[0].split("|")) == 45


def test_validation_fraction_rules() -> None:
    with pytest.raises(ConfigError, match=r"data\.validation_fraction: 0\.1 holds out training rows.*remove one"):
        DataConfig(train="t.jsonl", validation="d.jsonl", validation_fraction=0.1).validate()
    with pytest.raises(ConfigError, match=r"data.validation_fraction: 1 must be >= 0 and < 1"):
        DataConfig(train="t.jsonl", validation_fraction=1.0).validate()
    with pytest.raises(ConfigError, match=r"data\.validation: missing.*or data\.validation_fraction"):
        DataConfig(train="t.jsonl").validate()
    with pytest.raises(ConfigError, match=r"data\.dataset: set, and so is data\.train"):
        DataConfig(train="t.jsonl", dataset="d", validation_fraction=0.1).validate()


# ---- real data, and whole searches ----------------------------------------------------------------------------------


def _tsv_to_parquet(tsv: Path, parquet: Path) -> int:
    with tsv.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    pq.write_table(pa.Table.from_pylist([{"sentence": r["sentence"], "label": int(r["label"])} for r in rows]), parquet)
    return len(rows)


def test_sst2_as_parquet_reads_as_its_tsv(shared_data: Path, tmp_path: Path) -> None:
    sst2 = shared_data / "sst2"
    assert _tsv_to_parquet(sst2 / "dev.tsv", tmp_path / "dev.parquet") == 6735
    from_tsv = read_splits(
        DataConfig(train=str(sst2 / "dev.tsv"), validation=str(sst2 / "glue_dev.tsv"), text_column="sentence")
    )
    parquet = DataConfig(
        train=str(tmp_path / "dev.parquet"), validation=str(sst2 / "glue_dev.tsv"), text_column="sentence"
    )
    from_parquet = read_splits(parquet)
    assert from_parquet.train.texts == from_tsv.train.texts
    assert from_parquet.train.labels == [int(v) for v in from_tsv.train.labels]
    held = read_splits(DataConfig(train=str(tmp_path / "dev.parquet"), text_column="sentence", validation_fraction=0.1))
    assert len(held.validation.texts) == 674  # round(0.1 x 6735), both classes in their shares
    share = Counter(held.validation.labels)[1] / 674
    assert abs(share - Counter(from_tsv.train.labels)["1"] / 6735) < 0.002


@pytest.mark.slow
def test_search_from_a_parquet_pair(tmp_path: Path, tiny_model: Path, sqlite_url: str) -> None:
    train, dev = _write(tmp_path / "train.parquet", _rows(96, 13)), _write(tmp_path / "dev.parquet", _rows(32, 14))
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, train, dev, n_trials=1).replace("epochs = 2", "epochs = 1"))
    start_study("pq", spec, sqlite_url, tmp_path)
    import optuna

    (trial,) = optuna.load_study(study_name="pq", storage=sqlite_url).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.intermediate_values


@pytest.mark.slow
def test_search_from_a_saved_dataset_with_a_nested_column_and_a_share(
    tmp_path: Path, tiny_model: Path, sqlite_url: str
) -> None:
    import datasets

    rows = [{"review": {"text": r["text"]}, "label": r["label"]} for r in _rows(120, 15)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, Path("x"), Path("x"), n_trials=1).replace("epochs = 2", "epochs = 1")
    data = 'dataset = "saved"\ntext_column = "review.text"\nvalidation_fraction = 0.2\n'
    spec.write_text(text.replace('train = "x"\nvalidation = "x"\n', data))
    result = start_study("saved", spec, sqlite_url, tmp_path)
    assert "(the data.validation_fraction 0.2 held out)" in result.stderr
    import optuna

    (trial,) = optuna.load_study(study_name="saved", storage=sqlite_url).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.intermediate_values
    stored = optuna.load_study(study_name="saved", storage=sqlite_url).user_attrs[attrs.SPEC]
    assert stored["data"]["validation_fraction"] == 0.2 and stored["data"]["split_seed"] == 0
