"""The first hour of a new user: a search that went wrong says why, status shows every trial,
the dashboard names the metric, headerless files train, absurd input is refused, one log format."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest

from tests.conftest import Cli, assert_refused, hpsearch, spec_text
from tests.support.tiny import write_demo_split


@dataclass
class AllPruned:
    root: Path
    url: str
    start: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def all_pruned(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> AllPruned:
    """Two trials of the tiny model, which learns nothing in these steps: both stop at chance."""
    root = tmp_path_factory.mktemp("all-pruned")
    spec = root / "chance.toml"
    spec.write_text(
        spec_text(tiny_model, *demo_files, n_trials=2, prune_at_chance=2).replace("eval_every = 5", "eval_every = 2")
    )
    url = f"sqlite:///{root / 'db.sqlite'}"
    start = hpsearch(
        *("start", "--study", "c", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(root / "runs")),
        cwd=root,
    )
    return AllPruned(root, url, start)


def test_a_search_where_every_trial_is_pruned_says_why_and_what_to_change(all_pruned: AllPruned) -> None:
    start = all_pruned.start
    # No model came out of it: a script must not go on as if one had.
    assert start.returncode == 1, start.stderr[-3000:]
    assert "hpsearch start: error: no trial completed: 2 pruned (2 at chance)" in start.stderr
    summary = start.stdout
    assert "best: none; no trial completed: 2 pruned (2 at chance)" in summary
    assert re.search(r"best point reached: trial \d, loss 0\.\d{4} at step \d+ \(no checkpoint kept\)", summary)
    for fix in ("train.eval_every, now 2", "search.space.learning_rate, now 0.0001 to 0.003", "prune_at_chance = 0"):
        assert fix in summary, summary
    # `best` and `best --export` say the same, and neither claims success.
    best = hpsearch("best", "--study", "c", "--storage", all_pruned.url, cwd=all_pruned.root)
    export = all_pruned.root / "export"
    exported = hpsearch(
        "best", "--study", "c", "--storage", all_pruned.url, "--export", str(export), cwd=all_pruned.root
    )
    assert (best.returncode, exported.returncode) == (1, 1)
    assert best.stdout == exported.stdout
    assert "prune_at_chance = 0" in best.stdout and "best point reached: trial" in best.stdout
    assert "nothing to export" in exported.stderr and not export.exists()


def test_the_dashboard_names_the_metric_and_reads_the_spec(all_pruned: AllPruned) -> None:
    study = optuna.load_study(study_name="c", storage=all_pruned.url)
    assert study.metric_names == ["val_loss"]
    attrs = study.user_attrs
    assert attrs["spec: search.space"] == 'learning_rate = { type = "float", low = 0.0001, high = 0.003, log = true }'
    assert "n_trials = 2" in attrs["spec: search"] and 'pruner = "median"' in attrs["spec: search"]


def test_status_prints_a_row_per_trial_with_its_state_and_reason(all_pruned: AllPruned) -> None:
    status = hpsearch("status", "--study", "c", "--storage", all_pruned.url, cwd=all_pruned.root)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#  state"))
    assert lines[header].split() == [
        "#",
        "state",
        "loss",
        "step",
        "learning_rate",
        "time",
        "threads",
        "worker",
        "reason",
    ]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[:2] for r in rows] == [["0", "pruned"], ["1", "pruned"]]
    for row in rows:
        assert row[-2:] == ["at", "chance"]
        assert "/cpu:0/" in row[-3]  # the worker: host/device/pid
        assert row[-4] == "1"  # its torch threads: OMP_NUM_THREADS=1 (conftest.py) wins
        assert int(row[3]) < 20  # the step it reached, before the 20 of a full run
    # --watch ends by itself once the search has.
    watched = hpsearch("status", "--study", "c", "--storage", all_pruned.url, "--watch", "1", cwd=all_pruned.root)
    assert watched.returncode == 0 and "at chance" in watched.stdout


def test_one_log_format_without_optuna_chatter(all_pruned: AllPruned) -> None:
    log_lines = [line for line in all_pruned.start.stderr.splitlines() if re.search(r"\b(INFO|WARNING|ERROR)\b", line)]
    assert len(log_lines) > 10
    short = re.compile(r"^\d\d:\d\d:\d\d \[[^\]\s]+\] (DEBUG|INFO|WARNING|ERROR) ")
    odd = [line for line in log_lines if not short.match(line) and not line.startswith("hpsearch start: error:")]
    assert not odd, odd
    assert "A new study created" not in all_pruned.start.stderr
    workers = {m.group(1) for m in map(short.match, log_lines) if m and "/cpu:0/" in m.group(0)}
    assert workers, "the worker's lines name it"


# -- headerless files -----------------------------------------------------------------------------


def _headerless(path: Path, rows: int, seed: int) -> Path:
    """AG News' layout: label first, then the text, no header row."""
    src = write_demo_split(path.with_suffix(".jsonl"), rows, seed)
    lines = [json.loads(line) for line in src.read_text().splitlines()]
    path.write_text("".join(f"{r['label']}\t{r['text']}\n" for r in lines))
    return path


def test_a_headerless_tsv_trains(tiny_model: Path, tmp_path: Path) -> None:
    train, dev = _headerless(tmp_path / "train.tsv", 128, 0), _headerless(tmp_path / "dev.tsv", 64, 1)
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, train, dev, n_trials=1).replace(
        "[data]", "[data]\nheader = false\ntext_column = 1\nlabel_column = 0"
    )
    spec.write_text(text.replace("epochs = 2", "epochs = 1"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch(
        *("start", "--study", "h", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [trial] = optuna.load_study(study_name="h", storage=url).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    best = json.loads(hpsearch("best", "--study", "h", "--storage", url, "--json", cwd=tmp_path).stdout)
    labels = json.loads((Path(best["best_checkpoint"]) / "config.json").read_text())["id2label"]
    assert sorted(labels.values()) == ["negative", "positive"]  # the first row is an example, not names


def test_a_headerless_file_read_with_a_header_says_so(
    cli: Cli, tiny_model: Path, tmp_path: Path, demo_files: tuple[Path, Path]
) -> None:
    train = _headerless(tmp_path / "train.tsv", 32, 0)
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, train, demo_files[1]))
    line = assert_refused(cli, spec, tmp_path, "its first row does not look like a header")
    assert "set data.header = false" in line and "column positions" in line
    # Positions without header = false, and names with it, are each refused by key.
    spec.write_text(spec_text(tiny_model, train, demo_files[1]).replace("[data]", "[data]\ntext_column = 1"))
    assert "data.text_column: 1 is a column position, which needs data.header = false" in assert_refused(
        cli, spec, tmp_path, "data.text_column"
    )
    spec.write_text(spec_text(tiny_model, train, demo_files[1]).replace("[data]", "[data]\nheader = false"))
    assert "data.text_column: 'text' is a column name, but data.header = false" in assert_refused(
        cli, spec, tmp_path, "data.text_column"
    )


# -- absurd input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("n_trials", "2**70", "search.n_trials: 1180591620717411303424 must be at most 100,000"),
        ("timeout_minutes", "1e12", "search.timeout_minutes: 1000000000000.0 must be at most 527,040 (366 days)"),
        ("max_retries", "1000000", "search.max_retries: 1000000 must be at most 100"),
    ],
)
def test_an_absurd_budget_is_refused_with_its_limit(
    cli: Cli, spec_file: Path, tmp_path: Path, key: str, value: str, expected: str
) -> None:
    number = str(2**70) if value == "2**70" else value
    text = spec_file.read_text()
    text = (
        re.sub(rf"^{key} = .*$", f"{key} = {number}", text, flags=re.M)
        if f"\n{key} =" in text
        else (text.replace("[search]", f"[search]\n{key} = {number}"))
    )
    spec_file.write_text(text)
    assert_refused(cli, spec_file, tmp_path, expected)


def test_an_absurd_n_trials_flag_is_refused(cli: Cli, spec_file: Path, tmp_path: Path) -> None:
    result = cli(
        *("start", "--study", "x", "--config", str(spec_file), "--storage", f"sqlite:///{tmp_path / 'db'}"),
        *("--n-trials", str(2**70)),
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "--n-trials 1180591620717411303424: must be at most 100,000" in result.stderr
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_text_is_refused_with_its_line(
    cli: Cli, tiny_model: Path, tmp_path: Path, demo_files: tuple[Path, Path], text: str
) -> None:
    rows = demo_files[0].read_text().splitlines()
    rows[2] = json.dumps({"text": text, "label": "positive"})
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows) + "\n")
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, train, demo_files[1]))
    assert_refused(cli, spec, tmp_path, f"data file {train}: line 3: the text in column 'text' is empty")


def test_a_long_study_shows_its_latest_and_best_rows_unless_all() -> None:
    from hpsearch.search.views.status_text import format_trials

    def trial(n: int, value: float) -> dict[str, object]:
        return {
            "number": n,
            "state": "COMPLETE",
            "value": value,
            "step": 10,
            "params": {"learning_rate": 1e-4},
            "duration_s": 61.0,
            "worker": "h/cpu:0/1",
            "fail_reason": None,
        }

    # Trial 3 is the best; the latest 20 are 20..39.
    s = {"metric": "loss", "direction": "minimize", "trials": [trial(n, 0.1 if n == 3 else 1.0 + n) for n in range(40)]}
    rows = [line.split()[0] for line in format_trials(s).splitlines()[1:-1]]
    assert rows[:3] == ["0", "1", "3"] and rows[3:] == [str(n) for n in range(20, 40)]
    assert "17 more trials not shown" in format_trials(s)
    assert len(format_trials(s, every=True).splitlines()) == 41
    assert "1m01s" in format_trials(s)
