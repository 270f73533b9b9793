"""Bad input gives exit code 2, one line naming the field and the fix, and writes nothing."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import assert_refused, hpsearch, lm_spec_text, spec_text


def _causal_lm(spec: str) -> str:
    return spec.replace("max_length = 32", 'max_length = 32\ntask = "causal-lm"')


# (name, how to break the spec text, expected words in the message)
SPEC_CASES = [
    ("lr_negative", lambda s: s.replace("learning_rate = 1e-3", "learning_rate = -1.0"), "train.learning_rate"),
    (
        "unknown_train_key",
        lambda s: s.replace("[train]", "[train]\nlearnin_rate = 3"),
        "train.learnin_rate: unknown key; did you mean learning_rate?",
    ),
    (
        # The typo: a near key is named alone, not hidden in a list of thirty.
        "near_train_key",
        lambda s: s.replace("[train]", "[train]\nmicro_batch_sise = 8"),
        "train.micro_batch_sise: unknown key; did you mean micro_batch_size?",
    ),
    (
        "far_train_key",
        lambda s: s.replace("[train]", "[train]\noptimizer = 'sgd'"),
        "train.optimizer: unknown key; known keys: batch_size, ",
    ),
    (
        "near_space_key",
        lambda s: s.replace(
            "[search.space]", '[search.space]\nwarmup_ration = { type = "float", low = 0, high = 0.1 }'
        ),
        "search.space.warmup_ration: not a [train] key; did you mean warmup_ratio?",
    ),
    ("near_table", lambda s: s + "\n[trian]\nseed = 1\n", "trian: unknown table; did you mean [train]?"),
    (
        "micro_not_divisor",
        lambda s: s.replace("micro_batch_size = 16", "micro_batch_size = 12"),
        "train.micro_batch_size",
    ),
    ("bad_precision", lambda s: s.replace('precision = "fp32"', 'precision = "fp8"'), "train.precision"),
    (
        "fp16_on_cpu",
        lambda s: s.replace('precision = "fp32"', 'precision = "fp16"'),
        "train.precision: fp16 is not supported on CPU; use bf16, fp32 or auto",
    ),
    ("wrong_type", lambda s: s.replace("epochs = 2", 'epochs = "two"'), "train.epochs"),
    (
        "log_low_zero",
        lambda s: s.replace("low = 1e-4", "low = 0"),
        "search.space.learning_rate: low (0) must be > 0 when log = true",
    ),
    (
        "low_gt_high",
        lambda s: s.replace("low = 1e-4, high = 3e-3", "low = 1e-2, high = 3e-3"),
        "search.space.learning_rate: low",
    ),
    (
        "space_not_train_key",
        lambda s: s.replace("learning_rate = { type", "learning_rat = { type"),
        "search.space.learning_rat",
    ),
    ("bad_space_type", lambda s: s.replace('type = "float"', 'type = "double"'), "search.space.learning_rate.type"),
    ("bad_pruner", lambda s: s.replace('pruner = "median"', 'pruner = "wishful"'), "search.pruner"),
    ("bad_metric", lambda s: s.replace('metric = "loss"', 'metric = "bleu"'), "search.metric"),
    ("n_trials_zero", lambda s: s.replace("n_trials = 2", "n_trials = 0"), "search.n_trials"),
    ("unknown_table", lambda s: s + "\n[optimizer]\nname = 'sgd'\n", "optimizer: unknown table"),
    ("not_toml", lambda s: s.replace("[model]", "[model"), "not valid TOML"),
    ("missing_model", lambda s: s.replace("[model]\nname", "[model]\nnam"), "model.nam"),
    ("bad_task", lambda s: s.replace("max_length = 32", 'max_length = 32\ntask = "seq2seq"'), "model.task"),
    (
        "causal_lm_accuracy",
        lambda s: _causal_lm(s).replace('metric = "loss"', 'metric = "accuracy"'),
        'search.metric: \'accuracy\' is not defined for model.task = "causal-lm"; use metric = "loss"',
    ),
    (
        "devices_per_trial_zero",
        lambda s: s.replace("[train]", "[train]\ndevices_per_trial = 0"),
        "train.devices_per_trial: 0 must be between 1 and 64",
    ),
    (
        "global_batch_not_multiple",
        lambda s: s.replace("[train]", "[train]\ndevices_per_trial = 4"),
        "train.batch_size: 32 must be a multiple of micro_batch_size x devices_per_trial (16 x 4)",
    ),
    (
        "devices_per_trial_searched",
        lambda s: s.replace(
            "[search.space]", '[search.space]\ndevices_per_trial = { type = "categorical", choices = [1, 2] }'
        ),
        "search.space.devices_per_trial: cannot be searched",
    ),
    (
        "unknown_builtin_model",
        lambda s: s.replace('name = "', 'name = "builtin://gpt5"\n# "', 1),
        "model.name: 'builtin://gpt5' is not a built-in model; built-in: builtin://tiny-gpt2",
    ),
    (
        "space_choice_invalid",
        lambda s: s.replace(
            "learning_rate = { type",
            'micro_batch_size = { type = "categorical", choices = [16, 12] }\nlearning_rate = { type',
        ),
        "search.space.micro_batch_size: value 12",
    ),
    (
        "space_pair_invalid",  # each value is fine alone; batch 16 in micro-batches of 32 is not
        lambda s: s.replace(
            "learning_rate = { type",
            'batch_size = { type = "categorical", choices = [32, 16] }\n'
            'micro_batch_size = { type = "categorical", choices = [16, 32] }\nlearning_rate = { type',
        ),
        "search.space: batch_size = 16 with micro_batch_size = 32 gives an invalid trial: "
        "train.micro_batch_size: 32 must divide batch_size (16)",
    ),
    (
        "max_disk_inf",  # inf passed ">= 0" and then broke retention after every trial
        lambda s: s.replace("[search]", "[search]\nmax_disk_gb = inf"),
        "search.max_disk_gb: inf must be a finite number >= 0 (0 = no limit)",
    ),
    (
        "timeout_inf",
        lambda s: s.replace("[search]", "[search]\ntimeout_minutes = inf"),
        "search.timeout_minutes: inf must be a finite number >= 0",
    ),
    (
        "grid_too_large",  # listing four billion seeds took all memory before anything was said
        lambda s: s.replace('sampler = "tpe"', 'sampler = "grid"').replace(
            'learning_rate = { type = "float", low = 1e-4, high = 3e-3, log = true }',
            'seed = { type = "int", low = 0, high = 4000000000 }',
        ),
        "search.space.seed: the grid sampler would walk 4,000,000,001 values of it",
    ),
    (
        "grid_product_too_large",
        lambda s: s.replace('sampler = "tpe"', 'sampler = "grid"').replace(
            'learning_rate = { type = "float", low = 1e-4, high = 3e-3, log = true }',
            'seed = { type = "int", low = 0, high = 999 }\nlearning_rate = { type = "float", low = 0.001, '
            "high = 0.5, step = 0.001 }",
        ),
        "search.space: the grid has 500,000 points (1,000 (seed) x 500 (learning_rate))",
    ),
    # Issue 54: money has upper bounds (1e308 printed 309 digits), a long currency is not echoed whole, and a
    # spec nested past the parser's recursion is one line, not a RecursionError.
    (
        "price_huge",
        lambda s: s.replace("[search]", "[search]\nprice_per_gpu_hour = 1e308"),
        "search.price_per_gpu_hour: 1e+308 must be at most 1,000,000 per device hour (a typo beyond that",
    ),
    (
        "budget_huge",
        lambda s: s.replace("[search]", "[search]\nprice_per_gpu_hour = 2.0\nbudget = 1e308"),
        "search.budget: 1e+308 must be at most 1,000,000,000,000 (a trillion",
    ),
    (
        "currency_long",
        lambda s: s.replace("[search]", f"[search]\nprice_per_gpu_hour = 2.0\ncurrency = '{'E' * 10_000}'"),
        "... (10,002 characters) must be a short code",
    ),
    (
        "currency_escape",
        lambda s: s.replace("[search]", '[search]\nprice_per_gpu_hour = 2.0\ncurrency = "\\u001b[2J"'),
        "search.currency: '\\x1b[2J' must be a short code",
    ),
    ("deep_toml", lambda s: "a = " + "[" * 5000 + "]" * 5000 + "\n" + s, "nests arrays or tables too deeply"),
    (
        "byte_order_mark",  # a BOM is read past: the error is the spec's own, not "invalid TOML"
        lambda s: "\ufeff" + s.replace("n_trials = 2", "n_trials = 0"),
        "search.n_trials: 0 must be >= 1",
    ),
]


@pytest.mark.parametrize("name,mutate,expected", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_bad_spec(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], name: str, mutate, expected: str
) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "bad.toml"
    spec.write_text(mutate(spec_text(tiny_model, *demo_files)))
    assert_refused(cli, spec, tmp_path, expected)


def _write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


DATA_CASES = [
    ("missing_file", lambda d: d / "nope.jsonl", "does not exist"),
    ("empty_file", lambda d: _write(d / "empty.jsonl", ""), "has no rows"),
    ("wrong_column", lambda d: _write(d / "cols.jsonl", '{"sentence": "hi", "label": 1}\n'), "no column 'text'"),
    ("bad_json", lambda d: _write(d / "bad.jsonl", '{"text": "hi", "label": 1}\n{oops\n'), "line 2 is not valid JSON"),
    (
        "bad_encoding",
        lambda d: _write(d / "latin.jsonl", '{"text": "caf\u00e9", "label": 1}\n', "latin-1"),
        "not UTF-8",
    ),
    ("bad_extension", lambda d: _write(d / "data.xlsx", "x"), "unsupported format '.xlsx'; hpsearch reads .jsonl"),
    ("not_parquet", lambda d: _write(d / "data.parquet", "x"), "cannot be read as Parquet"),
    ("ragged_csv", lambda d: _write(d / "r.csv", "text,label\nhello,1,extra\n"), "line 2 has 3 fields"),
    (
        "deep_json_line",  # issue 54: a RecursionError traceback before
        lambda d: _write(d / "deep.jsonl", '{"text": ' + "[" * 100_000 + "]" * 100_000 + ', "label": 1}\n'),
        "line 1 nests too deeply to be a data row",
    ),
]


@pytest.mark.parametrize("name,make,expected", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_train_data(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], name: str, make, expected: str
) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tiny_model, make(tmp_path), demo_files[1]))
    assert_refused(cli, spec, tmp_path, expected)


LM_DATA_CASES = [
    ("empty_file", lambda d: _write(d / "empty.jsonl", ""), "has no rows"),
    (
        "no_text_field",
        lambda d: _write(d / "cols.jsonl", '{"sentence": "hi"}\n'),
        "row at line 1 has no column 'text' (nor 'prompt' + 'response'; columns: sentence)",
    ),
    (
        "prompt_without_response",
        lambda d: _write(d / "p.jsonl", '{"text": "fine"}\n{"prompt": "q"}\n'),
        "row at line 2 has no column 'text' (nor 'prompt' + 'response'",
    ),
    ("empty_response", lambda d: _write(d / "e.jsonl", '{"prompt": "q", "response": " "}\n'), "'response' is empty"),
    ("text_not_string", lambda d: _write(d / "n.jsonl", '{"text": 3}\n'), "line 1: 'text' must be text, got 3"),
]


@pytest.mark.parametrize("name,make,expected", LM_DATA_CASES, ids=[c[0] for c in LM_DATA_CASES])
def test_bad_causal_lm_data(
    cli, tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path], name: str, make, expected: str
) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_gpt2, make(tmp_path), lm_files[1]))
    assert_refused(cli, spec, tmp_path, expected)


def test_devices_not_divisible_by_devices_per_trial(
    cli, tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_gpt2, *lm_files, extra_train="devices_per_trial = 2"))
    message = (
        "hpsearch start: error: --devices cpu:3: 3 devices cannot be split into groups of train.devices_per_trial "
        "= 2; give a multiple of 2 devices (e.g. --devices cpu:2) or change train.devices_per_trial"
    )
    assert assert_refused(cli, spec, tmp_path, message, devices="cpu:3") == message


def test_validation_label_unseen_in_training(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    dev = _write(tmp_path / "dev.jsonl", '{"text": "the movie was fine", "label": "neutral"}\n')
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tiny_model, demo_files[0], dev))
    result = cli(
        "start", "--study", "x", "--config", str(spec), "--storage", f"sqlite:///{tmp_path / 'db'}", cwd=tmp_path
    )
    assert result.returncode == 2 and "label 'neutral', never seen in the training" in result.stderr


def test_missing_model_folder(cli, tmp_path: Path, demo_files: tuple[Path, Path]) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tmp_path / "no-model", *demo_files))
    result = cli(
        "start", "--study", "x", "--config", str(spec), "--storage", f"sqlite:///{tmp_path / 'db'}", cwd=tmp_path
    )
    assert result.returncode == 2 and "model.name" in result.stderr and "does not exist" in result.stderr, result.stderr


def test_model_folder_without_weights(cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:  # type: ignore[no-untyped-def]
    # Tokenizer and config load, so only the weights' absence can fail: every trial would.
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(model, *demo_files))
    assert_refused(cli, spec, tmp_path, f"model.name: folder {model} has no weights (model.safetensors or")


def test_hub_id_without_a_reachable_hub(cli, tmp_path: Path, demo_files: tuple[Path, Path], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Without this check huggingface_hub retried for half a minute, a warning line per retry.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text("someorg/somemodel", *demo_files))  # type: ignore[arg-type]
    line = assert_refused(cli, spec, tmp_path, "model.name: cannot load 'someorg/somemodel': not a local folder")
    assert line.endswith("(cannot reach http://127.0.0.1:9; set HF_ENDPOINT for a mirror)"), line


def test_model_folder_without_tokenizer(cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:  # type: ignore[no-untyped-def]
    # transformers 5 loads such a folder with a five-token tokenizer: every text became [UNK].
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, model / name)
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(model, *demo_files))
    assert_refused(cli, spec, tmp_path, f"model.name: folder {model} has no tokenizer files (tokenizer.json")


def test_model_folder_with_damaged_weights(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "cut-short"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a download cut short
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(model, *demo_files))
    assert_refused(cli, spec, tmp_path, f"model.name: folder {model}: model.safetensors is damaged (")


def test_searched_precision_the_devices_cannot_run(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "s.toml"
    space = 'precision = { type = "categorical", choices = ["fp32", "fp16"] }'
    spec.write_text(spec_text(tiny_model, *demo_files, space=space))
    assert_refused(cli, spec, tmp_path, "search.space.precision: choice 'fp16': train.precision: fp16 is not supported")


@pytest.mark.parametrize("name", ["x", "token-cache"])
def test_output_dir_holding_a_file_where_a_folder_goes(cli, tmp_path: Path, spec_file: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    # Every trial crashed on it (NotADirectoryError), three times, and wrote failed trials.
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / name).write_text("not a folder")
    result = cli(
        *("start", "--study", "x", "--config", str(spec_file), "--storage", f"sqlite:///{tmp_path / 'x.db'}"),
        *("--devices", "cpu:1", "--output-dir", str(runs)),
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert f"{runs / name} is a file, where hpsearch keeps a folder" in result.stderr, result.stderr
    assert not (tmp_path / "x.db").exists()


def test_storage_file_that_is_not_a_database(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "notes.db").write_text("not a database")
    result = cli("status", "--study", "x", "--storage", f"sqlite:///{tmp_path / 'notes.db'}", cwd=tmp_path)
    assert result.returncode == 2 and "file is not a database" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and (tmp_path / "notes.db").read_text() == "not a database"


CLI_CASES = [
    (["start", "--study", "x", "--devices", "gpu0"], "--devices gpu0"),
    (["start", "--study", "x", "--devices", "cpu:zero"], "--devices cpu:zero"),
    (["start", "--study", "x", "--devices", "3"], "no GPU 3"),
    (["start", "--study", "x", "--n-trials", "0"], "--n-trials 0"),
    (["start", "--study", "nospec"], "does not exist and has no spec"),
    (["start", "--study", "x", "--storage", "mysql://u:p@h/db"], "hpsearch supports"),
    (["start", "--study", "x", "--storage", "not a url"], "is not a URL"),
    (["start", "--study", "x", "--storage", "sqlite:///:memory:"], "in-memory SQLite"),
    (["status", "--study", "x"], "no study storage"),
    (["best", "--study", "x", "--storage", "postgresql://u:secretpw@127.0.0.1:1/db"], "nothing accepts connections"),
    (
        ["status", "--study", "x", "--storage", "postgresql://postgres:secretpw@127.0.0.1:5432/hpsearch_no_such_db"],
        "database hpsearch_no_such_db does not exist",
    ),
    (
        ["status", "--study", "x", "--storage", "postgresql://nobody:secretpw@127.0.0.1:5432/postgres"],
        "PostgreSQL has no user nobody",
    ),
    (["worker", "--study", "x", "--storage", "postgresql://u:pw@no-such-host.invalid:5432/db"], "cannot resolve host"),
    (["status", "--study", "x", "--storage", "postgresql://postgres@127.0.0.1:5432/test"], "holds no studies"),
    (["reap", "--study", "x", "--grace", "-5"], "--grace -5: must be a number of seconds >= 0"),
    # Issue 54: an empty --devices (an unset variable in a script) is not the default, and a device of 1e-300 GiB
    # does not "fit" every model.
    (["start", "--study", "x", "--devices", ""], "argument --devices: '' names no device"),
    (["worker", "--study", "x", "--devices", " "], "argument --devices: ' ' names no device"),
    (["plan", "--study", "x", "--devices", ""], "argument --devices: '' names no device"),
    (["plan", "--study", "x", "--device-memory", "1e-300"], "--device-memory 1e-300: must be a number of GiB from"),
    (["plan", "--study", "x", "--device-memory", "nan"], "--device-memory nan: must be a number of GiB from"),
    (["reap", "--study", "x", "--storage", "postgresql://postgres@127.0.0.1:5432/test"], "holds no studies"),
    (["start"], "the following arguments are required: --study"),
    (["start", "--study", "x", "--bogus"], "unrecognized arguments"),
    (
        ["start", "--study", "x", "--n-trials", "abc"],
        "--n-trials: invalid int value: 'abc' (see hpsearch start --help)",
    ),
    # A study name is a folder under --output-dir: "./a" would share (and overwrite) study a's.
    (["start", "--study", "./a"], "'./a' is not a study name"),
    (["worker", "--study", ""], "'' is not a study name"),
    (["start", "--study", "x" * 101], "is not a study name"),
    (["reap", "--study", "x", "--grace", "nan"], "--grace nan: must be a number of seconds >= 0"),
    # str.isdigit() says yes to these; int() refuses the first and reads the second as GPU 1.
    (["start", "--study", "x", "--devices", "cpu:²"], "--devices cpu:²: the CPU worker count must be an integer"),
    (["start", "--study", "x", "--devices", "\u0661"], "--devices \u0661: use GPU indices like 0,1"),
    (["status", "--study", "x", "--storage", "postgresql://postgres@127.0.0.1:abc/db"], "is not a URL"),
    (["status", "--study", "x", "--storage", "postgresql://postgres@[::1:5432/db"], "is not a URL"),
    (["status", "--study", "x", "--storage", "sqlite:////tmp"], "/tmp is a folder; name a file in it"),
    (
        ["status", "--study", "x", "--storage", "postgresql://postgres:secretpw@127.0.0.1:5432/postgres?foo=bar"],
        'invalid connection option "foo"; fix or remove that ?option',
    ),
]


@pytest.mark.parametrize("argv,expected", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_bad_cli(cli, tmp_path: Path, argv: list[str], expected: str) -> None:  # type: ignore[no-untyped-def]
    result = cli(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "secretpw" not in result.stderr + result.stdout, "passwords never appear in output"
    assert not (tmp_path / "hpsearch.db").exists()


@dataclass(frozen=True)
class Finished:
    root: Path
    spec: Path
    url: str


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> Finished:
    """A study of one finished trial, run once for the tests below that refuse things done to it (a start with
    another spec, bad names and exports). They leave it as they found it."""
    root = tmp_path_factory.mktemp("finished")
    spec = root / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files))
    url = f"sqlite:///{root / 'db.sqlite'}"
    ok = hpsearch(
        *("start", "--study", "s", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--n-trials", "1", "--output-dir", str(root / "runs")),
        cwd=root,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    return Finished(root, spec, url)


def test_existing_study_with_other_spec_is_refused(
    tmp_path: Path, finished: Finished, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    other = tmp_path / "other.toml"
    other.write_text(spec_text(tiny_model, *demo_files).replace("learning_rate = 1e-3", "learning_rate = 2e-3"))
    # In a real process: the refusal of a changed spec is one line, no traceback, from the installed CLI too.
    result = hpsearch("start", "--study", "s", "--config", str(other), "--storage", finished.url, cwd=tmp_path)
    assert result.returncode == 2
    assert "exists with a different spec (train.learning_rate: stored 0.001, given 0.002)" in result.stderr
    assert "Traceback" not in result.stderr
    import optuna

    assert len(optuna.load_study(study_name="s", storage=finished.url).trials) == 1


def test_a_finished_study_is_safe_from_bad_names_and_bad_exports(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, spec_file: Path, finished: Finished
) -> None:
    url = finished.url
    best = finished.root / "runs" / "s" / "trial-0" / "best"
    weights = (best / "model.safetensors").read_bytes()

    def refused(*argv: str) -> str:
        result = cli(*argv, "--storage", url, cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    assert "'./s' is not a study name" in refused("start", "--study", "./s", "--config", str(spec_file))
    assert "inside trial 0's own folder" in refused("best", "--study", "s", "--export", str(best.parent / "copy"))
    assert "cannot write there" in refused("best", "--study", "s", "--export", str(spec_file / "sub"))
    assert (best / "model.safetensors").read_bytes() == weights, "the finished trial's model is untouched"
    moved = tmp_path / "moved"
    best.rename(moved)
    try:
        assert "no longer exists on this host" in refused("best", "--study", "s", "--export", str(tmp_path / "e"))
    finally:
        moved.rename(best)
    (best / "model.safetensors").write_bytes(weights[:100])  # a disk error, or a copy cut short
    try:
        assert "model.safetensors is damaged" in refused("best", "--study", "s", "--export", str(tmp_path / "e"))
    finally:
        (best / "model.safetensors").write_bytes(weights)  # the shared study as it was
    assert not (tmp_path / "e").exists()


def test_start_does_not_adopt_a_study_made_with_optuna_itself(cli, tmp_path: Path, spec_file: Path) -> None:  # type: ignore[no-untyped-def]
    import optuna

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    foreign = optuna.create_study(study_name="foreign", storage=url, direction="maximize")
    foreign.add_trial(optuna.trial.create_trial(value=5.0))
    result = cli("start", "--study", "foreign", "--config", str(spec_file), "--storage", url, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "study 'foreign' exists but was not created by hpsearch (1 trials, maximize)" in result.stderr
    again = optuna.load_study(study_name="foreign", storage=url)
    assert len(again.trials) == 1 and "spec" not in str(again.user_attrs)


def test_output_dir_that_is_a_file(cli, tmp_path: Path, spec_file: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli(
        *("start", "--study", "x", "--config", str(spec_file), "--storage", f"sqlite:///{tmp_path / 'x.db'}"),
        *("--devices", "cpu:1", "--output-dir", str(spec_file)),
        cwd=tmp_path,
    )
    assert result.returncode == 2 and f"--output-dir {spec_file}: cannot write there" in result.stderr, result.stderr
    assert not (tmp_path / "x.db").exists()


def test_max_length_beyond_the_models_positions(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    import json as json_

    positions = json_.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tiny_model, *demo_files).replace("max_length = 32", f"max_length = {positions + 1}"))
    assert_refused(cli, spec, tmp_path, f"model.max_length: {positions + 1} is more than the model's {positions}")


def test_broken_tokenizer_file(cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "badtok"
    shutil.copytree(tiny_model, model)
    for f in model.glob("tokenizer*.json"):
        f.write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    (model / "vocab.txt").unlink(missing_ok=True)
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(model, *demo_files))
    assert_refused(cli, spec, tmp_path, f"model.name: {model} is a folder but not a loadable model/tokenizer")


def test_bad_input_through_the_installed_entry_point(tmp_path: Path) -> None:
    """The real process: exit status 2 and one line on stderr, no traceback."""
    result = hpsearch("start", "--study", "x", "--storage", "mysql://u:secretpw@h/db", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hpsearch start: error: storage URL 'mysql://u:***@h/db' uses 'mysql'; hpsearch supports postgresql://... and sqlite:///..."
    ]


def test_a_search_whose_every_trial_failed_exits_1_and_says_why(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """Input that only fails inside a trial is not caught up front; the run must still not end
    as if a search had happened. Here: a range of batch sizes too wide to check value by value,
    whose ends are multiples of micro_batch_size (16) and whose sampled values are not; the
    trainer checks each trial's values as it starts."""
    spec = tmp_path / "s.toml"
    space = 'batch_size = { type = "int", low = 16, high = 320016 }'
    spec.write_text(spec_text(tiny_model, *demo_files, space=space).replace('sampler = "tpe"', 'sampler = "qmc"'))
    result = hpsearch(
        *("start", "--study", "x", "--config", str(spec), "--storage", f"sqlite:///{tmp_path / 'x.db'}"),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "failed 2" in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hpsearch start: error: every trial failed (2); "), last
    assert "with: ConfigError: train.micro_batch_size: 16 must divide batch_size (" in last, last
    assert last.endswith(f"see {tmp_path / 'runs'}/x/trial-N/train.log"), last


def test_causal_lm_prompts_that_fill_max_length_are_refused_up_front(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, tiny_gpt2: Path
) -> None:
    """Only tokenising finds this; the data are tokenised before the study is created."""
    rows = "".join('{"prompt": "' + "a long prompt " * 20 + '", "response": " yes"}\n' for _ in range(8))
    train, dev = _write(tmp_path / "t.jsonl", rows), _write(tmp_path / "v.jsonl", rows)
    spec = tmp_path / "s.toml"
    spec.write_text(lm_spec_text(tiny_gpt2, train, dev).replace("max_length = 48", "max_length = 8"))
    assert_refused(cli, spec, tmp_path, "every row (8) is left out, as every token it trains on")


def test_a_classifier_checkpoint_with_another_label_count_loads(tiny_model: Path) -> None:
    """Fine-tuning a 2-label checkpoint on 3-class data replaces its head, as a new head would be."""
    from hpsearch.trainer.model import load_model

    model = load_model(str(tiny_model), 3)
    assert model.config.num_labels == 3
    assert model.classifier.out_features == 3  # type: ignore[union-attr]


def _damage(db: Path, *, pages: slice) -> None:
    """Overwrite some of a SQLite file's 4 KiB pages with garbage, as a full disk or a bad copy leaves it."""
    data = bytearray(db.read_bytes())
    n = len(data) // 4096
    for page in range(*pages.indices(n)):
        data[page * 4096 : (page + 1) * 4096] = b"Z" * 4096
    db.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def many_trials_db(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> Path:
    """A SQLite study with enough trials to fill pages beyond the schema's; each test damages its own copy."""
    import optuna

    from hpsearch.search.study import studies
    from hpsearch.search.study.spec import load_file
    from hpsearch.storage.open import open_storage

    root = tmp_path_factory.mktemp("many-trials")
    spec = root / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files))
    db = root / "study.db"
    storage = open_storage(f"sqlite:///{db}", create=True)
    try:
        study = studies.create_or_resume(storage, "x", load_file(spec))
        for _ in range(200):
            trial = study.ask()
            trial.suggest_float("learning_rate", 1e-4, 3e-3, log=True)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    finally:
        storage.close()
    return db


@pytest.mark.parametrize("pages", [slice(1, None), slice(-6, -3)], ids=["schema", "trials"])
def test_a_damaged_sqlite_file_is_said_in_one_line(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, spec_file: Path, many_trials_db: Path, pages: slice
) -> None:
    """Found at opening (its schema) or halfway through a command (its trials): one line either way, exit 2."""
    db = tmp_path / "study.db"
    shutil.copyfile(many_trials_db, db)  # closed cleanly: no WAL file beside it
    _damage(db, pages=pages)
    before = db.read_bytes()
    for argv in (["status"], ["start", "--config", str(spec_file), "--devices", "cpu:1"]):
        result = cli(*argv, "--study", "x", "--storage", f"sqlite:///{db}", cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "the SQLite file is damaged or not a database (database disk image is malformed)" in result.stderr
    assert db.read_bytes() == before and not (tmp_path / "hpsearch-runs").exists()


@pytest.mark.parametrize("folder", ["missing", "/proc"], ids=["missing", "read-only"])
def test_a_sqlite_file_that_cannot_be_made_is_said_before_the_data_are_read(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, spec_file: Path, folder: str
) -> None:
    """Said before tokenising: no token cache (nor any folder) is left by a `start` refused for its storage.
    /proc refuses every new file, even root's, as a read-only mount would."""
    db = (tmp_path / folder if folder == "missing" else Path(folder)) / "study.db"
    result = cli(
        *("start", "--study", "x", "--config", str(spec_file), "--devices", "cpu:1"),
        *("--storage", f"sqlite:///{db}", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot create SQLite storage sqlite:///{db}: folder {db.parent}" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists(), "a refused start wrote the token cache (or a folder)"


def test_config_that_is_a_pipe(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fifo = tmp_path / "spec.toml"
    os.mkfifo(fifo)
    line = assert_refused(cli, fifo, tmp_path, f"spec file {fifo} is not a regular file (a pipe or a device)")
    assert "does not exist" not in line


def test_lora_target_that_is_no_linear_layer_is_refused_up_front(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """LayerNorm names modules of the model, but no kind LoRA wraps: every trial would fail in peft."""
    spec = tmp_path / "s.toml"
    adapter = '[adapter]\nmethod = "lora"\ntarget_modules = ["LayerNorm"]\n'
    spec.write_text(adapter + spec_text(tiny_model, *demo_files))
    assert_refused(
        cli,
        spec,
        tmp_path,
        "adapter.target_modules: 'LayerNorm' names bert.embeddings.LayerNorm, a LayerNorm, which LoRA cannot adapt; "
        "name linear layers: classifier, dense, key, query, value",
    )


def test_a_stored_spec_that_is_invalid_is_refused_by_worker_and_start(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, spec_file: Path
) -> None:
    """A database writer stores a seed no sampler takes: `worker` and `start` refuse it in one line, write nothing."""
    import optuna

    from hpsearch.search.study import studies
    from hpsearch.search.study.spec import load_file
    from hpsearch.storage.open import open_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = open_storage(url, create=True)
    try:
        studies.create_or_resume(storage, "x", load_file(spec_file))
    finally:
        storage.close()
    study = optuna.load_study(study_name="x", storage=url)
    stored = study.user_attrs["hpsearch_spec"]
    stored["search"]["seed"] = -1
    study.set_user_attr("hpsearch_spec", stored)
    before = (tmp_path / "study.db").read_bytes()
    for command in ("worker", "start"):
        result = cli(command, "--study", "x", "--storage", url, "--devices", "cpu:1", cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip() == (
            f"hpsearch {command}: error: study 'x': its stored spec fails its checks (search.seed: -1 must be "
            "between 0 and 4294967295 (2**32 - 1)); a database writer changed it and no trial runs on it: restore "
            "it from a backup, or start a new study"
        )
    assert (tmp_path / "study.db").read_bytes() == before and not (tmp_path / "hpsearch-runs").exists()
