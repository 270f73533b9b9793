"""`import hpsearch`: a search started from Python outlives the process that started it, another process finds
it, waits for it and gets its trials and best model; bad input is the CLI's one line as an HpsearchError;
`hpsearch --version` and `hpsearch list`. Real processes, real storages, a tiny model trained for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpsearch.storage import urls
from tests.conftest import hpsearch, spec_text

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _python(code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``code`` in a new Python process, as a script or a notebook's kernel would run it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HPSEARCH_STORAGE", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _ends_with_the_test(request: pytest.FixtureRequest, pid: int | None) -> None:
    """A detached search this test started ends with it, passed or failed (its storage is dropped): SIGTERM to its
    session (the keeper leads it), SIGKILL to what is left after 30 s."""
    if pid is None:
        return
    group = os.getsid(pid)

    def end() -> None:
        for sig, pause in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline:
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.5)

    request.addfinalizer(end)


def _spec(tiny_model: Path, demo_files: tuple[Path, Path], **kw: Any) -> dict[str, Any]:
    return tomllib.loads(spec_text(tiny_model, *demo_files, **kw))


def test_version_is_the_installed_one(tmp_path: Path) -> None:
    from importlib.metadata import version

    import hpsearch as api

    result = hpsearch("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hpsearch {version('hpsearch')}"
    assert api.__version__ == version("hpsearch")


def test_a_bad_spec_dict_raises_the_line_the_cli_prints(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    import hpsearch as api

    bad = _spec(tiny_model, demo_files)
    bad["train"]["batch_size"] = 0
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(api.HpsearchError) as raised:
        api.start("bad", bad, storage=url, devices="cpu:1", output_dir=tmp_path / "runs")
    line = str(raised.value)
    assert isinstance(raised.value, api.InputError) and raised.value.exit_code == 2
    assert "train.batch_size" in line and "\n" not in line
    # The CLI says the very same line of the same spec written as a file.
    (tmp_path / "bad.toml").write_text(spec_text(tiny_model, *demo_files).replace("batch_size = 32", "batch_size = 0"))
    cli = hpsearch("start", "--study", "bad", "--config", "bad.toml", "--storage", url, cwd=tmp_path)
    assert cli.returncode == 2
    assert cli.stderr.strip() == f"hpsearch start: error: {line}"
    assert not (tmp_path / "study.db").exists() and not (tmp_path / "runs").exists(), "bad input wrote something"


def test_what_the_detached_cli_refuses_is_raised_in_the_caller(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """A check only the CLI makes (the data file exists): its line comes back from the detached process."""
    import hpsearch as api

    spec = _spec(tiny_model, demo_files)
    spec["data"]["train"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(api.InputError) as raised:
        api.start("x", spec, storage=f"sqlite:///{tmp_path / 's.db'}", devices="cpu:1", output_dir=tmp_path / "runs")
    assert "missing.jsonl" in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(api.InputError, match="not a study name"):
        api.start("no spaces", spec, storage=f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(api.InputError, match="does not exist"):
        api.load("nothing", f"sqlite:///{tmp_path / 's.db'}")


@pytest.mark.slow
def test_a_search_started_without_waiting_outlives_its_process(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], storage_url: str, request: pytest.FixtureRequest
) -> None:
    """Process A starts the search with wait=False and exits; process B loads it, waits, reads the trials and the
    best checkpoint; the test loads that checkpoint with plain from_pretrained."""
    spec = _spec(tiny_model, demo_files)
    runs = tmp_path / "runs"
    started = _python(
        "import hpsearch, json, os\n"
        f"s = hpsearch.start('api', json.loads({json.dumps(json.dumps(spec))}), storage={storage_url!r}, "
        f"devices='cpu:1', output_dir={str(runs)!r}, wait=False)\n"
        "print(json.dumps({'log': str(s.log), 'pid': s._pid, 'sid': os.getsid(0)}))\n",
        tmp_path,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    a = json.loads(started.stdout.strip().splitlines()[-1])
    _ends_with_the_test(request, a["pid"])
    # A has exited; the search it started runs on, in a session of its own.
    assert Path(a["log"]) == runs / "api" / "search.log"
    assert os.getsid(a["pid"]) != a["sid"]
    early = optuna.load_study(study_name="api", storage=urls.normalize(storage_url))
    assert len([t for t in early.trials if t.state.is_finished()]) < 2, "start(wait=False) waited for the trials"

    waited = _python(
        "import hpsearch, json\n"
        f"s = hpsearch.load('api', {storage_url!r})\n"
        "st = s.wait(timeout=500, progress=True)\n"
        "df = s.trials()\n"
        "b = s.best\n"
        "print(json.dumps({'over': st.over, 'states': st.states, 'rows': len(df), 'columns': list(df.columns),\n"
        "  'df_states': sorted(df['state']), 'checkpoint': str(b.checkpoint), 'is_path': type(b.checkpoint).__name__,\n"
        "  'number': b.number, 'value': b.value, 'metrics': b.metrics, 'text': str(st)}))\n",
        tmp_path,
    )
    assert waited.returncode == 0, waited.stderr[-3000:]
    b = json.loads(waited.stdout.strip().splitlines()[-1])
    assert b["over"] is True and b["states"]["complete"] + b["states"]["pruned"] == 2
    assert b["rows"] == 2 and b["df_states"].count("COMPLETE") == b["states"]["complete"] >= 1
    for column in ("number", "state", "value", "params_learning_rate", "checkpoint", "device_hours", "fail_reason"):
        assert column in b["columns"]
    assert b["is_path"] == "PosixPath" and b["checkpoint"] == str(runs / "api" / f"trial-{b['number']}" / "best")
    assert "loss" in b["metrics"] and b["metrics"]["loss"] == pytest.approx(b["value"])
    assert "trials" in b["text"]
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(b["checkpoint"])
    assert model.config.num_labels == 2
    log = runs / "api" / "search.log"
    deadline = time.monotonic() + 60  # the supervisor prints its summary after the last trial is recorded
    while "ended with exit code" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "ended with exit code 0" in log.read_text() and "study api: 2 trials" in log.read_text()

    # The same study, from this process: the model and tokenizer ready to predict, a plot, `list`.
    import torch

    import hpsearch as api

    search = api.load("api", storage_url)
    model, tokenizer = search.load_best()
    with torch.no_grad():
        logits = model(**tokenizer(["a fine film", "a dull film"], return_tensors="pt", padding=True)).logits
    assert tuple(logits.shape) == (2, 2) and not model.training
    figure = search.plot("history")
    assert len(figure.data) >= 1 and len(figure.data[0].x) == b["states"]["complete"]
    with pytest.raises(api.InputError, match="one of history"):
        search.plot("pie")
    exported = search.export(tmp_path / "export")
    assert json.loads((exported / "hpsearch_best.json").read_text())["trial"] == b["number"]
    (row,) = api.studies(storage_url)
    assert (row.name, row.n_trials, row.best_value) == ("api", 2, pytest.approx(b["value"]))
    listed = hpsearch("list", "--storage", storage_url, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:3] == ["api", "2", "of"]


@pytest.mark.slow
def test_stop_hands_back_the_running_trial(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], request: pytest.FixtureRequest
) -> None:
    import hpsearch as api
    from hpsearch.search.python_api.search import _runs_study

    url = f"sqlite:///{tmp_path / 'study.db'}"
    spec = _spec(tiny_model, demo_files, n_trials=3, extra_train="max_steps = 400\nresume_every_minutes = 0")
    spec["train"]["epochs"] = 40
    search = api.start("long", spec, storage=url, devices="cpu:1", output_dir=tmp_path / "runs", wait=False)
    _ends_with_the_test(request, search._pid)
    deadline = time.monotonic() + 240
    while search.status().states["running"] == 0:
        assert time.monotonic() < deadline, "no trial started"
        time.sleep(1)
    pid = search._pid
    assert pid is not None and _runs_study(pid, "long")
    # A Search that did not start it (as load() in a new kernel) finds it through the worker registry, and stops it.
    stopped = api.load("long", url).stop(wait=True, timeout=200)
    assert not _runs_study(pid, "long")
    # The running trial was handed back: a retry waits to resume it from its saved state.
    assert stopped.states["running"] == 0 and stopped.states["waiting"] == 1 and not stopped.over
    assert "ended with exit code 143" in (tmp_path / "runs" / "long" / "search.log").read_text()
    with pytest.raises(api.SearchError, match="no hpsearch process"):
        search.stop()


def test_plan_is_the_cli_plan_as_data(tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    import hpsearch as api

    plan = api.plan(_spec(tiny_model, demo_files), devices="cpu:1", device_memory_gib=1.0)
    e = plan.estimate
    assert e.total == e.weights + e.gradients + e.optimizer + e.casts + e.gathered + e.activations > 0
    assert plan.verdict == "fits" and plan.memory == 2**30
    with pytest.raises(api.InputError, match=r"'bert-lx': no such spec file here, nor a preset \(bert-lr, "):
        api.plan("bert-lx")
    with pytest.raises(api.InputError, match=r"spec file .*missing.toml does not exist"):
        api.plan(Path("missing.toml"))
    with pytest.raises(api.InputError, match="--device-memory"):
        api.plan(_spec(tiny_model, demo_files), device_memory_gib=-1)


NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebook.ipynb"


def _execute(nb: Any, cwd: Path) -> Any:
    """Run ``nb`` in a real Jupyter kernel (ipykernel, through nbclient) in ``cwd``; its kernel is shut down at the
    end, as closing a notebook does. A failing cell raises with its traceback."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def _notebook_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spec: Path, study: str) -> str:
    """The worked notebook's settings (its first cell reads them): a tiny model instead of the bert-lr preset."""
    url = f"sqlite:///{tmp_path / 'notebook.db'}"
    for key, value in {
        "HPSEARCH_NOTEBOOK_CONFIG": str(spec),
        "HPSEARCH_NOTEBOOK_STUDY": study,
        "HPSEARCH_STORAGE": url,
        "HPSEARCH_NOTEBOOK_DEVICES": "cpu:1",
        "HF_HUB_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    return url


def _text(cell: Any) -> str:
    return "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", [])
    )


@pytest.mark.slow
def test_the_worked_notebook_runs_in_a_real_kernel(
    tmp_path: Path, spec_file: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    import nbformat

    url = _notebook_env(monkeypatch, tmp_path, spec_file, "nb")
    nb = _execute(nbformat.read(NOTEBOOK, as_version=4), tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "search.log" in _text(code[1])  # start(wait=False) returned the search and its log
    study = optuna.load_study(study_name="nb", storage=urls.normalize(url))
    assert len([t for t in study.trials if t.state.is_finished()]) == 2, "the notebook's wait() returned early"
    table = next(c for c in code if "search.trials()" in c.source)
    assert "<table" in str(table.outputs[0]["data"]["text/html"]) and "params_learning_rate" in _text(table)
    plot = next(c for c in code if "search.plot(" in c.source)
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in plot.outputs)
    predicted = _text(code[-1])
    assert "a gripping, beautifully acted film" in predicted and "a tedious mess from start to finish" in predicted


@pytest.mark.slow
def test_a_new_kernel_finds_the_search_the_shut_down_kernel_started(
    tmp_path: Path, spec_file: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Kernel 1 starts the search (wait=False) and is shut down mid-search; kernel 2 loads it and waits: every
    trial finished."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    url = _notebook_env(monkeypatch, tmp_path, spec_file, "kernels")
    first = nbformat.read(NOTEBOOK, as_version=4)
    starting = [c for c in first.cells if c.cell_type == "code"][:2]
    starting.append(new_code_cell("print('PID', search._pid)"))
    ran = _execute(new_notebook(cells=starting, metadata=first.metadata), tmp_path)
    pid = int(_text(ran.cells[-1]).split("PID")[1].split()[0])
    _ends_with_the_test(request, pid)
    # Kernel 1 is shut down; its search is not over, and runs on.
    study = optuna.load_study(study_name="kernels", storage=urls.normalize(url))
    assert len([t for t in study.trials if t.state.is_finished()]) < 2
    os.kill(pid, 0)
    waiting = new_code_cell(
        "import hpsearch, os\n"
        "st = hpsearch.load('kernels', os.environ['HPSEARCH_STORAGE']).wait()\n"
        "print('OVER', st.over, st.finished + st.states['fail'], st.best.checkpoint is not None)"
    )
    ran = _execute(new_notebook(cells=[waiting], metadata=first.metadata), tmp_path)
    assert "OVER True 2 True" in _text(ran.cells[0])
    finished = optuna.load_study(study_name="kernels", storage=urls.normalize(url))
    assert len([t for t in finished.trials if t.state.is_finished()]) == 2


def test_list_shows_a_study_hpsearch_did_not_create(tmp_path: Path) -> None:
    """A plain Optuna study beside ours (same database): listed with its trials and best value, without a budget
    and without a worker registry to read."""
    import hpsearch as api

    url = f"sqlite:///{tmp_path / 'plain.db'}"
    study = optuna.create_study(study_name="plain", storage=url)
    study.optimize(lambda t: (t.suggest_float("x", 0, 1) - 0.25) ** 2, n_trials=3)
    (row,) = api.studies(url)
    assert (row.name, row.n_trials, row.metric, row.live_workers) == ("plain", None, None, 0)
    assert row.states["complete"] == 3 and row.best_value == pytest.approx(study.best_value)
    listed = hpsearch("list", "--storage", url, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:3] == ["plain", "3", "(not"]
    as_json = json.loads(hpsearch("list", "--json", "--storage", url, cwd=tmp_path).stdout)
    assert as_json[0]["name"] == "plain" and as_json[0]["states"]["complete"] == 3
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    with pytest.raises(api.InputError, match="no study storage"):
        api.studies(missing)
    cli = hpsearch("list", "--storage", missing, cwd=tmp_path)
    assert cli.returncode == 2 and cli.stderr.startswith("hpsearch list: error: no study storage")
