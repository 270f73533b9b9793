"""``hpsearch.start``, ``load``, ``studies`` and ``plan``: the calls that make a ``Search`` (search.py here) or read
a storage or a spec. ``start`` runs the real `hpsearch start` detached (detach.py) after checking a dict spec here,
so that its one line comes at once; every other check is the CLI's own."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from hpsearch.search.cli.list_command import StudyRow, list_studies
from hpsearch.search.cli.main import DEFAULT_OUTPUT_DIR, study_name
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.presets import PRESETS, preset_file
from hpsearch.search.python_api.errors import HpsearchError, InputError, SearchError, raised_as_hpsearch_errors
from hpsearch.search.python_api.search import Search
from hpsearch.search.study.space import toml_text
from hpsearch.search.study.spec import StudySpec, load_file
from hpsearch.storage import urls


def start(
    study: str,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    storage: str | None = None,
    devices: str | Sequence[int] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    n_trials: int | None = None,
    wait: bool = True,
) -> Search:
    """`hpsearch start` from Python. ``config``: a spec file, a dict of the spec's tables, or a preset name
    (``bert-lr``); None as for the CLI (./STUDY.toml, the stored spec, a preset of that name). The search runs
    detached from this process (its own session; its output in ``OUTPUT_DIR/STUDY/search.log``): this returns once
    every check passed, or raises the CLI's one line as ``HpsearchError``. ``wait``: also wait until it is over
    (Ctrl-C then stops it, as in a terminal); with ``wait=False`` it returns at once and the search runs on after
    this process (a notebook's kernel) ends."""
    from hpsearch.search.cli import detach

    with raised_as_hpsearch_errors(storage):
        _check_study_name(study)
        url = urls.resolve(storage)
        urls.normalize(url)  # a malformed URL fails here, as in the CLI
        out = Path(output_dir) if output_dir is not None else DEFAULT_OUTPUT_DIR
        args = ["start", "--study", study, "--output-dir", str(out.resolve())]
        with tempfile.TemporaryDirectory(prefix="hpsearch-spec-") as tmp:
            args += _config_args(study, config, Path(tmp))
            if devices is not None:
                args += ["--devices", devices if isinstance(devices, str) else ",".join(map(str, devices))]
            if n_trials is not None:
                args += ["--n-trials", str(n_trials)]
            # The URL in the environment, not the command line: `ps` shows a command line to every user.
            env = {**os.environ, "HPSEARCH_STORAGE": url}
            launched = detach.launch(args, out.resolve() / study, env)
    if launched.pid is None:
        raise _ended_at_start(launched)
    search = Search(study, url, pid=launched.pid, log=launched.log)
    if wait:
        try:
            search.wait()
        except KeyboardInterrupt:
            with suppress(HpsearchError):  # it ended meanwhile: nothing to stop, and the interrupt is what to say
                search.stop()  # what Ctrl-C does to `hpsearch start` in a terminal
            raise
    return search


def _check_study_name(study: str) -> None:
    import argparse

    try:
        study_name(study)
    except argparse.ArgumentTypeError as exc:
        raise InputError(f"argument --study: {exc}") from None


def _ended_at_start(launched: Any) -> Exception:
    """The error of an `hpsearch start` that ended before its checks passed: its own one line where it said one."""
    prefix = "hpsearch start: error: "
    said = [line.removeprefix(prefix) for line in launched.output if line.startswith(prefix)]
    if said:
        return InputError(said[-1]) if launched.exit_code == ExitCode.USAGE else SearchError(said[-1])
    tail = "; ".join(launched.output[-3:]) or "no output"
    return SearchError(f"hpsearch start ended with exit code {launched.exit_code} before its checks passed: {tail}")


def _config_args(study: str, config: str | os.PathLike[str] | Mapping[str, Any] | None, tmp: Path) -> list[str]:
    """--config for the CLI: a dict is checked here (its one line at once) and written as a spec file in ``tmp``."""
    if config is None:
        return []
    if isinstance(config, Mapping):
        spec = spec_of(config)
        path = tmp / f"{study}.toml"
        path.write_text(_toml(spec.to_dict()))
        if load_file(path).identity() != spec.identity():  # a bug of _toml, never the user's
            raise RuntimeError(f"the spec written to {path} does not read back as the dict given")
        return ["--config", str(path)]
    return ["--config", str(_spec_path(config))]


def _spec_path(config: str | os.PathLike[str]) -> Path:
    path = Path(config)
    if path.exists():
        return path.resolve()
    preset = preset_file(str(config))
    if preset is not None:
        return preset
    if path.suffix or len(path.parts) > 1:  # meant as a file: load_file says what is wrong with it
        return path.resolve()
    raise InputError(f"config {str(config)!r}: no such spec file here, nor a preset ({', '.join(PRESETS)})")


def spec_of(config: str | os.PathLike[str] | Mapping[str, Any]) -> StudySpec:
    """A spec from a dict of its tables (relative paths from the current folder), a spec file, or a preset name."""
    if isinstance(config, Mapping):
        return StudySpec.from_dict(dict(config), base_dir=Path.cwd())
    return load_file(_spec_path(config))


def _toml(spec: dict[str, Any]) -> str:
    """A stored spec (``StudySpec.to_dict``) as TOML: a table per section, [search.space] of inline tables. None
    means the default, which TOML cannot write: left out."""
    lines = []
    for table, body in spec.items():
        lines.append(f"[{table}]")
        lines += [f"{_key(k)} = {_value(v)}" for k, v in body.items() if v is not None and not isinstance(v, dict)]
        for name, sub in body.items():
            if isinstance(sub, dict):
                lines.append(f"[{table}.{name}]")
                lines += [f"{_key(k)} = {_value(v)}" for k, v in sub.items() if v is not None]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return toml_text(value)


def load(study: str, storage: str | None = None) -> Search:
    """The study ``study`` in ``storage`` (default: $HPSEARCH_STORAGE, else ./hpsearch.db), running or not."""
    url = urls.resolve(storage)
    search = Search(study, url)
    search._read(best_only=True)  # a study that does not exist is said now, with the studies there
    return search


def studies(storage: str | None = None) -> list[StudyRow]:
    """`hpsearch list` as data: every study in ``storage``, its trials by state, best value and live workers."""
    with raised_as_hpsearch_errors(storage):
        return list_studies(urls.resolve(storage))


def plan(
    config: str | os.PathLike[str] | Mapping[str, Any],
    devices: str | Sequence[int] | None = None,
    device_memory_gib: float | None = None,
) -> Any:
    """`hpsearch plan` as data (search/study/plan.py ``Plan``): per device, the bytes of weights, gradients, optimizer
    state and activations a trial of ``config`` needs (``estimate``), its ``verdict`` against the devices'
    memory, and what each change would need (``alternatives``); ``line()`` says it in words."""
    from hpsearch.search.cli.plan_command import plan_for

    text = devices if devices is None or isinstance(devices, str) else ",".join(map(str, devices))
    with raised_as_hpsearch_errors(None):
        return plan_for(spec_of(config), text, device_memory_gib)
