"""Shared fixtures: a tiny local BERT, demo data, specs, and real storages (SQLite and PostgreSQL)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest

from tests.support.tiny import build_tiny_bert, build_tiny_gpt2, write_demo_split, write_lm_split

PG_ADMIN_URL = os.environ.get("HPSEARCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")

# One torch thread per process, in the workers the tests start (they inherit the variable;
# hpsearch gives a CPU worker OMP_NUM_THREADS threads) and in pytest's own process. Tiny models
# gain nothing from more, and where another job holds a core (CI machines are shared) OpenMP
# threads waiting on it stall every step: the two killed-worker tests took 425 s with one of
# two cores busy, 51 s with one thread. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The modules whose slowest test took 90 s or more in the last full run (wall, at a load of ~12), longest first
# (`pytest --durations=0`; docs/development.md "How long the suite takes"). A module not listed runs after these, in
# its usual order.
SLOW_MODULES = (
    "test_multi_worker.py",
    "test_end_to_end.py",
    "test_cost_objective.py",
    "test_retention.py",
    "test_mixed_precision.py",
    "test_lora.py",
    "test_lora_defaults.py",
    "test_chat.py",
    "test_early_points.py",
    "test_study_creation.py",
    "test_dashboard.py",
    "test_data_parallel.py",
    "test_faults.py",
    "test_trust_files.py",
    "test_trust_paths.py",
    "test_pruning.py",
    "test_progress.py",
    "test_sharded_trials.py",
    "test_bad_input.py",
    "test_data_sources.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest modules first. xdist's worksteal hands each worker a contiguous share of this order, then
    moves tests that have not started from a busy worker to an idle one: a 100 s test that starts last
    keeps one core busy while the other idles, one that starts first is balanced by the many short tests
    after it. A module stays together (its module-scoped fixtures run once per worker), and the order is
    the same on every worker, as xdist requires. Runs after pytest's own reordering (trylast)."""
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model")


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("data")
    return write_demo_split(root / "train.jsonl", 320, 1), write_demo_split(root / "dev.jsonl", 96, 2)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2") / "model")


@pytest.fixture(scope="session")
def lm_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Causal-LM text rows ({"text": ...}): train and validation."""
    root = tmp_path_factory.mktemp("lm-data")
    return write_lm_split(root / "train.jsonl", 192, 1), write_lm_split(root / "dev.jsonl", 48, 2)


def lm_spec_text(model: Path, train: Path, dev: Path, *, extra_train: str = "", search: str = "") -> str:
    """A causal-LM spec for a tiny model: a few optimizer steps, fp32, median pruning; no early points (as
    spec_text: they would move the steps the pruner judges)."""
    return f"""
[model]
name = "{model}"
task = "causal-lm"
max_length = 48
[data]
train = "{train}"
validation = "{dev}"
[train]
learning_rate = 3e-3
batch_size = 16
micro_batch_size = 8
epochs = 1
eval_every = 4
precision = "fp32"
resume_every_minutes = 0
{extra_train}
[search]
n_trials = 1
sampler = "random"
pruner = "median"
metric = "loss"
early_points = false
{search}
[search.space]
learning_rate = {{ type = "float", low = 1e-4, high = 3e-2, log = true }}
"""


def spec_text(
    model: Path,
    train: Path,
    dev: Path,
    *,
    n_trials: int = 2,
    extra_train: str = "",
    space: str = 'learning_rate = { type = "float", low = 1e-4, high = 3e-3, log = true }',
    search: str = "",
    prune_at_chance: int = 0,
    early_points: bool = False,
) -> str:
    # The tiny random-initialised BERT learns nothing in these few steps: with the default
    # prune_at_chance every trial would stop at chance; tests that want that turn it on. Early
    # pruning points (on by default) would add validations at steps 1-2 of every trial and move
    # the steps the pruner judges: off, but in the tests of early points (test_early_points.py).
    return f"""
[model]
name = "{model}"
max_length = 32
[data]
train = "{train}"
validation = "{dev}"
[train]
learning_rate = 1e-3
batch_size = 32
micro_batch_size = 16
epochs = 2
eval_every = 5
precision = "fp32"
{extra_train}
[search]
n_trials = {n_trials}
sampler = "tpe"
pruner = "median"
metric = "loss"
seed = 0
prune_at_chance = {prune_at_chance}
early_points = {"true" if early_points else "false"}
{search}
[search.space]
{space}
"""


@pytest.fixture
def spec_file(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(spec_text(tiny_model, *demo_files))
    return path


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
"""Real data the project does not ship (../shared/data from the project root; CI has the same copy)."""


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``SHARED_DATA``; a test on real data skips where it is absent, and fails in CI, which must provide it."""
    if not (SHARED_DATA / "sst2" / "train.tsv").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"the real data is not at {SHARED_DATA} (CI must put ../shared/data beside its clone)")
        pytest.skip(f"real data not at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


def _pg_available() -> bool:
    try:
        import psycopg2

        psycopg2.connect(PG_ADMIN_URL.replace("postgresql://", "postgresql://", 1), connect_timeout=3).close()
        return True
    except Exception:
        return False


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A throwaway database on the machine's PostgreSQL server, dropped afterwards."""
    import psycopg2

    if not _pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL} (CI must start it)")
        pytest.skip("PostgreSQL server not reachable")
    name = f"hpsearch_test_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(PG_ADMIN_URL)
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        cur = admin.cursor()
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest) -> str:
    """Run a test against every storage backend: SQLite always, PostgreSQL for real."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


def hpsearch(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("HPSEARCH_STORAGE", None) if env is None or "HPSEARCH_STORAGE" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_study(study: str, spec: Path, url: str, root: Path) -> subprocess.CompletedProcess[str]:
    """`hpsearch start` on one CPU worker, as a user would type it; asserts it succeeded."""
    result = hpsearch(
        *("start", "--study", study, "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(root / "runs")),
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_trial(study: str, spec: Path, url: str, root: Path) -> optuna.trial.FrozenTrial:
    """`start_study` of a spec that runs one trial; that trial, complete."""
    start_study(study, spec, url, root)
    (trial,) = optuna.load_study(study_name=study, storage=url).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    return trial


class CliResult:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


Cli = Callable[..., CliResult]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """The CLI's own main() in-process (fast); the subprocess path is covered by other tests."""
    from hpsearch.search.cli.main import main

    def run(*argv: str, cwd: Path) -> CliResult:
        monkeypatch.chdir(cwd)
        monkeypatch.delenv("HPSEARCH_STORAGE", raising=False)
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


def assert_refused(cli: Cli, spec: Path, tmp_path: Path, expected: str, devices: str = "cpu:1") -> str:
    """`start` with this spec: exit 2, one line naming the problem, no storage created; returns the line."""
    db = tmp_path / "study.db"
    result = cli(
        *("start", "--study", "x", "--config", str(spec), "--storage", f"sqlite:///{db}", "--devices", devices),
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("hpsearch start: error: "), result.stderr
    assert not db.exists(), "bad input must not create the storage"
    assert not (tmp_path / "hpsearch-runs").exists(), "bad input must not leave an (empty) output folder"
    return result.stderr.strip()
