"""What hpsearch reads from a runs folder, a data file or a model folder is input (issue 54): a planted FIFO hangs
nothing, a link is not followed, a resumable state's values are checked before they are used, an output folder
swapped for a link mid-run gets no write nor deletion, an impossible model config is refused in one line, and
files holding what the data says are no more readable than the data."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpsearch.storage import regular
from hpsearch.storage.trialdir import TrialDir, TrialDirError
from hpsearch.trainer import checkpoint as ckpt
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.model import load_tokenizer
from tests.conftest import Cli, assert_refused, hpsearch, spec_text
from tests.support.tiny import train_tiny

CFG = TrainConfig(learning_rate=2e-3, batch_size=32, micro_batch_size=16, epochs=2, eval_every=5, precision="fp32")
HANG_S = 60  # far more than any of these takes; a FIFO that is waited on never returns


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, which must return within ``seconds``: a read that waits on a FIFO would not (its thread is left)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s (a FIFO read or opened?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture(scope="module")
def prepared(tiny_model: Path, demo_files: tuple[Path, Path]) -> tuple[Any, Any]:
    tok = load_tokenizer(str(tiny_model))
    return tok, prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)


@pytest.fixture(scope="module")
def stopped_state(tiny_model: Path, prepared: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run's resumable state at step 5 (of 20): what the tampering below starts from."""
    out = tmp_path_factory.mktemp("stopped")
    calls = {"n": 0}

    def stop_after_step_5() -> bool:
        calls["n"] += 1
        return calls["n"] >= 5

    _, result, _ = train_tiny(tiny_model, prepared, CFG, out, should_stop=stop_after_step_5)
    assert result.status == "interrupted" and result.steps == 5
    return out / "resume" / "state.pt"


def _resume(tiny_model: Path, prepared: tuple[Any, Any], state: Path, out: Path) -> tuple[Any, Any]:
    _, result, reporter = _within(HANG_S, lambda: train_tiny(tiny_model, prepared, CFG, out, resume_from=state))
    return result, reporter


@pytest.mark.parametrize("step", [10**12, -50, 21, "5", True])
def test_a_planted_step_neither_completes_the_run_nor_breaks_it(
    tiny_model: Path,
    prepared: tuple[Any, Any],
    stopped_state: Path,
    tmp_path: Path,
    step: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = tmp_path / "run"
    (out / "resume").mkdir(parents=True)
    saved = ckpt.load_resume(stopped_state)
    torch.save({**saved, "step": step}, out / "resume" / "state.pt")
    with caplog.at_level(logging.WARNING):
        result, reporter = _resume(tiny_model, prepared, out / "resume" / "state.pt", out)
    # Trained all 20 steps from step 0: its first validation point (step 5) is its own, not the state's.
    assert result.status == "complete" and result.steps == 20
    assert sorted(reporter.values) == [5, 10, 15, 20]
    assert "discarded; training from step 0" in caplog.text and "step" in caplog.text


def test_the_untampered_state_still_resumes(
    tiny_model: Path, prepared: tuple[Any, Any], stopped_state: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    (out / "resume").mkdir(parents=True)
    shutil.copy(stopped_state, out / "resume" / "state.pt")
    result, reporter = _resume(tiny_model, prepared, out / "resume" / "state.pt", out)
    assert result.status == "complete" and sorted(reporter.values) == [10, 15, 20], "it continued from step 5"


@pytest.mark.parametrize("planted", ["state_fifo", "state_link", "oom_fifo", "meta_fifo"])
def test_a_fifo_or_link_in_the_resume_folder_is_not_read_nor_waited_on(
    tiny_model: Path, prepared: tuple[Any, Any], stopped_state: Path, tmp_path: Path, planted: str
) -> None:
    out = tmp_path / "run"
    resume = out / "resume"
    resume.mkdir(parents=True)
    shutil.copy(stopped_state, resume / "state.pt")
    if planted == "state_fifo":
        (resume / "state.pt").unlink()
        os.mkfifo(resume / "state.pt")
    elif planted == "state_link":  # a good state, but somebody else's file: never read through a link
        (resume / "state.pt").unlink()
        (resume / "state.pt").symlink_to(stopped_state)
    elif planted == "oom_fifo":
        os.mkfifo(resume / "out_of_memory.json")
    else:
        (out / "best").mkdir()
        os.mkfifo(out / "best" / "hpsearch.json")
    result, reporter = _resume(tiny_model, prepared, resume / "state.pt", out)
    assert result.status == "complete" and result.steps == 20
    resumed = planted in ("oom_fifo", "meta_fifo")  # the state itself is good there
    assert sorted(reporter.values) == ([10, 15, 20] if resumed else [5, 10, 15, 20])
    assert stopped_state.exists(), "the link's target is untouched"


def test_a_fifo_as_train_log_or_lock_or_token_cache_hangs_nobody(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path
) -> None:
    folder = TrialDir(tmp_path / "runs" / "s", 3)
    folder.make()
    os.mkfifo(folder.log)
    os.mkfifo(folder.path / ".hpsearch.lock")
    with _within(HANG_S, folder.open_log) as log_file:  # replaced by a regular file, with a warning
        log_file.write("line\n")
    assert stat.S_ISREG(folder.log.lstat().st_mode) and folder.log.read_text() == "line\n"
    with folder.deleting() as free:  # the lock cannot be taken: nothing deleted, nothing waits
        assert free is False

    tok = load_tokenizer(str(tiny_model))
    cfg = DataConfig(train=str(demo_files[0]), validation=str(demo_files[1]))
    cache = tmp_path / "runs" / "token-cache"
    first = prepare(cfg, tok, 32, cache)
    [meta] = cache.glob("tokens-*/meta.json")
    written = meta.parent
    os.unlink(written / "train.arrow")  # a split's file, then the whole entry, made FIFOs
    os.mkfifo(written / "train.arrow")
    assert _within(HANG_S, lambda: prepare(cfg, tok, 32, cache)).train.input_ids == first.train.input_ids
    shutil.rmtree(written)
    os.mkfifo(written)
    written.with_suffix(".lock").unlink()
    os.mkfifo(written.with_suffix(".lock"))
    again = _within(HANG_S, lambda: prepare(cfg, tok, 32, cache))
    assert again.train.input_ids == first.train.input_ids


def test_an_output_folder_swapped_for_a_link_mid_run_gets_no_write_nor_deletion(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    folder = TrialDir(runs / "s", 0)  # as a worker has it: the output folder resolved at start
    folder.make()
    (folder.best).mkdir()
    (folder.best / "model.safetensors").write_text("the trial's")
    # Someone swaps the output folder for a link to a tree of the same shape.
    victim = tmp_path / "victim"
    (victim / "s" / "trial-0" / "best").mkdir(parents=True)
    (victim / "s" / "trial-0" / "best" / "keep.txt").write_text("precious")
    (victim / "s" / "trial-0" / "resume").mkdir()
    (victim / "s" / "trial-0" / "resume" / "state.pt").write_text("precious")
    runs.rename(tmp_path / "moved")
    runs.symlink_to(victim, target_is_directory=True)

    assert not folder.is_real() and not folder.remove(folder.best)  # retention's deletion
    with pytest.raises(TrialDirError):
        folder.make()
    with pytest.raises(OSError, match="through a link"):
        ckpt.temp_dir(folder.best)  # a checkpoint's write
    with pytest.raises(OSError, match="through a link"):
        ckpt.record_out_of_memory(folder.out_of_memory, 4, 1, 0)
    with pytest.raises(OSError, match="through a link"):
        ckpt.load_resume(folder.state)
    assert ckpt.best_meta(folder.best) is None
    later = TrialDir(runs / "s", 1)
    with pytest.raises(TrialDirError):
        later.make()
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == [
        "s",
        "s/trial-0",
        "s/trial-0/best",
        "s/trial-0/best/keep.txt",
        "s/trial-0/resume",
        "s/trial-0/resume/state.pt",
    ], "nothing was written into, or deleted from, the tree the link points at"


def test_regular_opens_only_regular_files(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(regular.NotRegularFile, match="is a FIFO"):
        _within(HANG_S, lambda: regular.read_text(tmp_path / "fifo", 100))
    with pytest.raises(regular.NotRegularFile):  # to write: no reader, and no wait for one
        _within(HANG_S, lambda: regular.open_file(tmp_path / "fifo", "a"))
    with pytest.raises(regular.NotRegularFile, match="is a link"):
        regular.read_text(tmp_path / "link", 100)
    assert regular.read_text(tmp_path / "link", 100, follow=True) == "x" * 10  # a data file the user names
    with pytest.raises(regular.NotRegularFile, match="more than 5"):
        regular.read_text(tmp_path / "file", 5)
    with pytest.raises(regular.NotRegularFile, match="is a character device"):
        regular.read_bytes(Path("/dev/null"), 10, follow=True)


# -- model configs (plan, start) ---------------------------------------------------------------------------------

ABSURD = {
    "hidden_size": ({"hidden_size": 10**12}, "hidden_size = 1000000000000 must be an integer from 1"),
    "vocab_size": ({"vocab_size": -5}, "vocab_size = -5 must be an integer from 1"),
    "heads": ({"hidden_size": 33, "num_attention_heads": 2}, "hidden_size 33 is not a multiple of"),
    "layers": ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 must be an integer from 1"),
    "float": ({"intermediate_size": 64.5}, "intermediate_size"),  # transformers 5 refuses it first, in one line
    "parameters": (
        {"hidden_size": 2**17, "intermediate_size": 2**20, "num_hidden_layers": 1000, "num_attention_heads": 64},
        "parameters, more than hpsearch plans or trains",
    ),
}


def _absurd_model(tiny_model: Path, tmp_path: Path, change: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


@pytest.mark.parametrize("case", list(ABSURD))
def test_plan_and_start_refuse_an_impossible_model_config_in_one_line(
    cli: Cli, tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path, case: str
) -> None:
    change, expected = ABSURD[case]
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(_absurd_model(tiny_model, tmp_path, change), *demo_files))
    began = time.monotonic()
    planned = cli("plan", "--study", "x", "--config", str(spec), "--devices", "cpu:1", cwd=tmp_path)
    assert time.monotonic() - began < HANG_S
    assert planned.returncode == 2 and "Traceback" not in planned.stderr, planned.stderr
    assert len(planned.stderr.strip().splitlines()) == 1 and expected in planned.stderr, planned.stderr
    assert planned.stderr.startswith("hpsearch plan: error: model.name: ")
    assert_refused(cli, spec, tmp_path, expected)


def test_a_fifo_as_data_file_or_model_config_is_refused_by_start_and_plan(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    os.mkfifo(tmp_path / "train.jsonl")
    cases = {
        "model": (spec_text(model, *demo_files), "config.json is a FIFO, not a file"),
        "data": (spec_text(tiny_model, tmp_path / "train.jsonl", demo_files[1]), "train.jsonl is a FIFO"),
    }
    for name, (text, expected) in cases.items():
        spec = tmp_path / f"{name}.toml"
        spec.write_text(text)
        db = tmp_path / f"{name}.db"
        commands = {"start": ("--storage", f"sqlite:///{db}", "--output-dir", str(tmp_path / "runs"))}
        if name == "model":
            commands["plan"] = ()
        for command, extra in commands.items():
            result = hpsearch(
                command,
                "--study",
                "x",
                "--config",
                str(spec),
                "--devices",
                "cpu:1",
                *extra,
                cwd=tmp_path,
                timeout=HANG_S * 2,
            )
            assert result.returncode == 2, result.stderr[-2000:]
            assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr, result.stderr
        assert not db.exists()


# -- modes of data-derived files ---------------------------------------------------------------------------------


def test_files_holding_the_data_are_no_more_readable_than_the_data(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    train, dev = (shutil.copy(f, data / f.name) for f in demo_files)
    for f in (train, dev):
        os.chmod(f, 0o600)
    old = os.umask(0o022)
    try:
        tok = load_tokenizer(str(tiny_model))
        prepared = prepare(DataConfig(train=str(train), validation=str(dev)), tok, 32, tmp_path / "cache")
        [meta] = (tmp_path / "cache").glob("tokens-*/meta.json")
        _, result, _ = train_tiny(tiny_model, (tok, prepared), CFG, tmp_path / "run")
    finally:
        os.umask(old)
    assert {stat.S_IMODE(f.stat().st_mode) for f in meta.parent.iterdir()} == {0o600}
    assert stat.S_IMODE(meta.parent.stat().st_mode) == 0o700
    assert result.best_step is not None
    best = tmp_path / "run" / "best"
    assert stat.S_IMODE((best / "config.json").stat().st_mode) == 0o600  # the label names
    assert {stat.S_IMODE(f.stat().st_mode) for f in best.iterdir() if f.is_file()} == {0o600}
    # Data others may read gives files others may read (the umask still applies).
    for f in (train, dev):
        os.chmod(f, 0o644)
    shared = prepare(DataConfig(train=str(train), validation=str(dev)), tok, 32, None)
    assert shared.mode == 0o644 and prepared.mode == 0o600


# -- sharded state over two real gloo ranks ----------------------------------------------------------------------


def _sharded_rank(rank: int, port: int, model_dir: str, files: tuple[str, str], out: str, resume: str | None) -> None:
    """One rank of a two-rank sharded run (as test_sharded_training.py's), resuming from ``resume``; records how it
    ended and the warnings it logged."""
    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer import distributed, meta_model
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache
    from tests.support.tiny import files_in

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    world = distributed.join(rank, 2, port, torch.device("cpu"))
    try:
        tokenizer = load_tokenizer(model_dir)
        data = prepare(DataConfig(train=files[0], validation=files[1]), tokenizer, 48, None, task="causal-lm")
        cfg = TrainConfig(
            learning_rate=3e-3, batch_size=16, micro_batch_size=4, max_steps=4, eval_every=2, precision="fp32",
            seed=3, resume_every_minutes=0, sharding="fsdp", devices_per_trial=2,
        )  # fmt: skip
        if rank > 0:
            model = meta_model.empty_model(model_dir, None, None)
        else:
            model = PretrainedCache().trial_model(model_dir, None, cfg.seed, None, private=True)
        run = Run(model=model, tokenizer=tokenizer, data=data, cfg=cfg, metric="loss", device=torch.device("cpu"),
                  files=files_in(Path(out)), resume_from=Path(resume) if resume else None)  # fmt: skip
        run.world = world
        reporter = NullReporter()
        try:
            result = fit(run, reporter)
            ended = {"status": str(result.status), "steps": result.steps, "points": sorted(reporter.values)}
        except Exception as exc:
            ended = {"error": type(exc).__name__}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({**ended, "warnings": warnings}))
    finally:
        world.close()
    distributed.end_process(0)


def _two_sharded_ranks(
    model_dir: Path, files: tuple[Path, Path], out: Path, resume: Path | None
) -> list[dict[str, Any]]:
    from hpsearch.trainer import distributed

    store = distributed.main_store(2)
    ctx = torch.multiprocessing.get_context("spawn")
    args = (store.port, str(model_dir), (str(files[0]), str(files[1])), str(out), str(resume) if resume else None)
    ranks = [ctx.Process(target=_sharded_rank, args=(r, *args)) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(240)
    assert [p.exitcode for p in ranks] == [0, 0], "a rank aborted, or hangs"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_tampered_sharded_state_aborts_no_rank_and_is_not_resumed_twice(
    tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]
) -> None:
    import pickle

    first = tmp_path / "first"
    assert [r["status"] for r in _two_sharded_ranks(tiny_gpt2, lm_files, first, None)] == ["complete"] * 2
    assert (first / "resume" / "shards" / ".metadata").is_file()  # the state of step 2 (of 4)

    def variant(name: str) -> Path:
        out = tmp_path / name
        out.mkdir()
        shutil.copytree(first / "resume", out / "resume")
        return out / "resume" / "shards"

    # 0. Untampered: resumed at step 2 by every rank (its one point is step 4's).
    variant("good")
    ranks = _two_sharded_ranks(tiny_gpt2, lm_files, tmp_path / "good", tmp_path / "good" / "resume" / "state.pt")
    assert [(r["status"], r["steps"]) for r in ranks] == [("complete", 4)] * 2 and ranks[0]["points"] == [4], ranks
    # 1. An index whose first tensor lies far past the end of its file.
    shards = variant("offsets")
    index = pickle.loads((shards / ".metadata").read_bytes())
    info = next(iter(index.storage_data.values()))
    info.offset = 10**12
    (shards / ".metadata").write_bytes(pickle.dumps(index))
    # 2. A shard file that is a FIFO.
    shards = variant("fifo")
    [part, *_] = sorted(shards.glob("*.distcp"))
    part.unlink()
    os.mkfifo(part)
    for name in ("offsets", "fifo"):
        ranks = _two_sharded_ranks(tiny_gpt2, lm_files, tmp_path / name, tmp_path / name / "resume" / "state.pt")
        # Every rank trained from step 0 (its step-2 point is its own), after one warning.
        assert [(r["status"], r["steps"]) for r in ranks] == [("complete", 4)] * 2, ranks
        assert all(sum("discarded; training from step 0" in w for w in r["warnings"]) == 1 for r in ranks), ranks
        assert ranks[0]["points"] == [2, 4]

    # 3. Shard bytes damaged inside their bounds: found only as torch reads them, on every rank at once (no rank
    # waits or aborts); the state is discarded, so the retry cannot resume into the same failure.
    shards = variant("bytes")
    for part in shards.glob("*.distcp"):
        part.write_bytes(b"\0" * part.stat().st_size)
    ranks = _two_sharded_ranks(tiny_gpt2, lm_files, tmp_path / "bytes", tmp_path / "bytes" / "resume" / "state.pt")
    assert [r.get("error") for r in ranks] == ["DamagedState"] * 2, ranks
    assert not (tmp_path / "bytes" / "resume" / "state.pt").exists() and not shards.exists()


def test_a_fifo_planted_in_the_best_checkpoint_does_not_hang_its_export(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """`best --export` copies the best folder: a FIFO planted there would block the copy forever."""
    from tests.conftest import one_trial

    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("fifo", spec, url, tmp_path)
    best = Path(trial.user_attrs["best_checkpoint"])
    os.mkfifo(best / "planted")
    args = ("best", "--study", "fifo", "--storage", url, "--export", str(tmp_path / "out"))
    result = hpsearch(*args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "is not a regular file; refusing to export it" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert (best / "model.safetensors").is_file(), "the checkpoint itself is left as it was"
