"""Spec values of the wrong shape, type or range are refused when the spec is loaded: exit code 2,
one line naming the field and the fix, no traceback, nothing written to the storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Cli, assert_refused, spec_text

LR = "learning_rate = { type = "


def _space(line: str) -> Callable[[str], str]:
    """Replace the spec's one search.space line (learning_rate) with ``line``."""

    def mutate(s: str) -> str:
        start = s.index(LR)
        end = s.index("\n", start)
        return s[:start] + line + s[end:]

    return mutate


def _enqueue(space_line: str, entry: str) -> Callable[[str], str]:
    return lambda s: _space(space_line)(s).replace("[search.space]", f"[[search.enqueue]]\n{entry}\n[search.space]")


def _drop_line(prefix: str) -> Callable[[str], str]:
    return lambda s: "\n".join(line for line in s.splitlines() if not line.startswith(prefix))


def _scalar(name: str, value: str) -> Callable[[str], str]:
    """Drop table ``[name]`` (and its sub-tables) and write ``name = value`` at the top instead."""

    def mutate(s: str) -> str:
        out, skip = [], False
        for line in s.splitlines():
            if line.startswith("["):
                skip = line.strip("[]").split(".")[0] == name
            if not skip:
                out.append(line)
        return f"{name} = {value}\n" + "\n".join(out)

    return mutate


LR_GRID = 'learning_rate = { type = "float", low = 1e-3, high = 5e-3, step = 1e-3 }'

# (name, how to break the spec text, expected words in the message)
CASES: list[tuple[str, Callable[[str], str], str]] = [
    # 1. a scalar where a table belongs
    (
        "search_is_a_number",
        _scalar("search", "3"),
        "search: must be a table, written [search] on a line of its own with its keys below it; got search = 3",
    ),
    (
        "search_is_a_string",
        _scalar("search", '"abc"'),
        'search: must be a table, written [search] on a line of its own with its keys below it; got search = "abc"',
    ),
    ("model_is_a_number", _scalar("model", "3"), "model: must be a table, written [model]"),
    ("data_is_a_string", _scalar("data", '"train.jsonl"'), "data: must be a table, written [data]"),
    ("train_is_a_list", _scalar("train", "[1, 2]"), "train: must be a table, written [train]"),
    (
        "space_is_a_number",
        lambda s: s.split("[search.space]")[0] + "space = 3\n",
        "search.space: must be a table of parameters",
    ),
    (
        "space_entry_is_a_number",
        _space("learning_rate = 3e-4"),
        'search.space.learning_rate: must be a table like { type = "float", low = 1e-5, high = 1e-3 }',
    ),
    (
        "enqueue_entry_is_a_number",
        lambda s: s.replace("[search]", "[search]\nenqueue = [3]"),
        "search.enqueue[0]: must be a non-empty table of parameters",
    ),
    # 2. step, low and high
    (
        "step_true",
        _space('learning_rate = { type = "float", low = 1e-3, high = 5e-3, step = true }'),
        "search.space.learning_rate.step: true must be a finite number > 0",
    ),
    (
        "step_inf",
        _space('learning_rate = { type = "float", low = 1e-3, high = 5e-3, step = inf }'),
        "search.space.learning_rate.step: inf must be a finite number > 0",
    ),
    (
        "step_zero",
        _space('learning_rate = { type = "float", low = 1e-3, high = 5e-3, step = 0 }'),
        "search.space.learning_rate.step: 0 must be a finite number > 0",
    ),
    (
        "step_negative",
        _space('learning_rate = { type = "float", low = 1e-3, high = 5e-3, step = -1e-3 }'),
        "search.space.learning_rate.step: -0.001 must be a finite number > 0",
    ),
    (
        "int_step_fraction",
        _space('epochs = { type = "int", low = 1, high = 3, step = 0.5 }'),
        'search.space.epochs.step: 0.5 must be an integer >= 1 for type = "int"',
    ),
    (
        "int_step_zero",
        _space('epochs = { type = "int", low = 1, high = 3, step = 0 }'),
        'search.space.epochs.step: 0 must be an integer >= 1 for type = "int"',
    ),
    (
        "high_inf",
        _space('learning_rate = { type = "float", low = 1e-4, high = inf }'),
        "search.space.learning_rate.high: inf must be a finite number",
    ),
    (
        "low_nan",
        _space('learning_rate = { type = "float", low = nan, high = 1e-3 }'),
        "search.space.learning_rate.low: nan must be a finite number",
    ),
    (
        "low_missing",
        _space('learning_rate = { type = "float", high = 1e-3 }'),
        'search.space.learning_rate.low: missing; type = "float" needs low and high (or use choices)',
    ),
    # 3. the parameter's type must fit the [train] field's
    (
        "float_range_on_int_field",
        _space('batch_size = { type = "float", low = 16, high = 32 }'),
        'search.space.batch_size: type = "float" does not fit train.batch_size, which takes an integer; '
        'use type = "int" (low, high, optional step) or type = "categorical" with integer choices',
    ),
    (
        "float_range_on_micro_batch",
        _space('micro_batch_size = { type = "float", low = 8, high = 16 }'),
        'search.space.micro_batch_size: type = "float" does not fit train.micro_batch_size, which takes an '
        "integer or 'auto'",
    ),
    (
        "int_range_on_bool_field",
        _space('compile = { type = "int", low = 0, high = 1 }'),
        'search.space.compile: type = "int" does not fit train.compile, which takes true or false; '
        'use type = "categorical" with choices',
    ),
    (
        "float_choices_on_int_field",
        _space('batch_size = { type = "categorical", choices = [16.0, 32.0] }'),
        "search.space.batch_size: choice 16.0 does not fit train.batch_size, which takes an integer",
    ),
    # 4. enqueued trials follow the [train] rules and the step grid
    (
        # Each searched value is a valid trial on its own; the enqueued pair is not.
        "enqueue_breaks_micro_batch_rule",
        _enqueue(
            'batch_size = { type = "int", low = 16, high = 64, step = 16 }\n'
            'micro_batch_size = { type = "categorical", choices = [16, 32] }',
            "batch_size = 16\nmicro_batch_size = 32",
        ),
        # The space itself holds that pair, so the check of pairs of searched values finds it first.
        "search.space: batch_size = 16 with micro_batch_size = 32 gives an invalid trial: "
        "train.micro_batch_size: 32 must divide batch_size (16)",
    ),
    (
        # A range too wide to check in pairs: only the enqueued combination is checked.
        "enqueue_breaks_micro_batch_rule_wide_range",
        _enqueue(
            'batch_size = { type = "int", low = 16, high = 160016, step = 16 }\n'
            'micro_batch_size = { type = "categorical", choices = [16, 32] }',
            "batch_size = 16\nmicro_batch_size = 32",
        ),
        "search.enqueue[0]: batch_size = 16, micro_batch_size = 32 gives an invalid trial: "
        "train.micro_batch_size: 32 must divide batch_size (16)",
    ),
    (
        # The ends (16, 32) pass the rule; the sampler may still propose 17..31.
        "int_range_inside_breaks_micro_batch_rule",
        _space('batch_size = { type = "int", low = 16, high = 32 }'),
        "search.space.batch_size: value 17 gives an invalid trial: train.micro_batch_size: 16 must divide "
        "batch_size (17)",
    ),
    (
        "enqueue_off_float_step",
        _enqueue(LR_GRID, "learning_rate = 1.5e-3"),
        "search.enqueue[0].learning_rate: 0.0015 is not on the search grid (low + a multiple of step 0.001); "
        "the nearest values are 0.001 and 0.002",
    ),
    (
        "enqueue_off_int_step",
        _enqueue('epochs = { type = "int", low = 1, high = 5, step = 2 }', "epochs = 2"),
        "search.enqueue[0].epochs: 2 is not on the search grid (low + a multiple of step 2); "
        "the nearest values are 1 and 3",
    ),
    # 5. non-finite floats and the seed's range in [train]
    (
        "weight_decay_inf",
        lambda s: s.replace("[train]", "[train]\nweight_decay = inf"),
        "train.weight_decay: inf must be a finite number",
    ),
    (
        "learning_rate_inf",
        lambda s: s.replace("learning_rate = 1e-3", "learning_rate = inf"),
        "train.learning_rate: inf must be a finite number",
    ),
    (
        "max_grad_norm_nan",
        lambda s: s.replace("[train]", "[train]\nmax_grad_norm = nan"),
        "train.max_grad_norm: nan must be a finite number",
    ),
    (
        "seed_too_big",
        lambda s: s.replace("[train]", "[train]\nseed = 100000000000000000000"),
        "train.seed: 100000000000000000000 must be between 0 and 4294967295 (2**32 - 1)",
    ),
    ("seed_negative", lambda s: s.replace("[train]", "[train]\nseed = -1"), "train.seed: -1 must be between 0"),
    # 5b. counts beyond any search that ends, said as too large before any rule that combines them (#42)
    ("search_seed_negative", lambda s: s.replace("seed = 0", "seed = -1"), "search.seed: -1 must be between 0"),
    (
        "search_seed_int64",
        lambda s: s.replace("seed = 0", "seed = 9223372036854775807"),
        "search.seed: 9223372036854775807 must be between 0 and 4294967295 (2**32 - 1)",
    ),
    (
        "epochs_huge",
        lambda s: s.replace("epochs = 2", "epochs = 1000000000000"),
        "train.epochs: 1000000000000 must be at most 100,000",
    ),
    (
        "batch_size_huge",
        lambda s: s.replace("batch_size = 32", "batch_size = 99999999999999999999999"),
        "train.batch_size: 99999999999999999999999 must be at most 10,000,000",
    ),
    # 5c. paths no file call can take, and pkg:// references beyond hpsearch's own packages (#42)
    (
        "model_name_part_too_long",
        lambda s: s.replace('name = "', 'name = "/tmp/' + "m" * 300 + '/x"  # "', 1),
        "model.name: a part of the path is 300 bytes long (mmmmmmmmmmmmmmmmmmmm...), more than the 255",
    ),
    (
        "data_train_part_too_long",
        lambda s: s.replace('train = "', 'train = "' + "t" * 300 + '.jsonl"  # "', 1),
        "data.train: a part of the path is 306 bytes long",
    ),
    (
        "model_name_unknown_user",
        lambda s: s.replace('name = "', 'name = "~nosuchuser/model"  # "', 1),
        "model.name: ~nosuchuser names no user of this host; write the full path",
    ),
    (
        "data_validation_unknown_user",
        lambda s: s.replace('validation = "', 'validation = "~nosuchuser/dev.jsonl"  # "', 1),
        "data.validation: ~nosuchuser names no user of this host",
    ),
    (
        "pkg_of_another_package",
        lambda s: s.replace('train = "', 'train = "pkg://this/x.tsv"  # "', 1),
        "data.train: 'pkg://this/x.tsv' names package 'this'; pkg:// reaches only pkg://hpsearch.search.presets/",
    ),
    (
        "pkg_of_a_module_s_main",
        lambda s: s.replace('name = "', 'name = "pkg://pygments.__main__"  # "', 1),
        "model.name: 'pkg://pygments.__main__' names package 'pygments.__main__'; pkg:// reaches only",
    ),
    (
        "pkg_out_of_its_package",
        lambda s: s.replace('train = "', 'train = "pkg://hpsearch.search.presets/../../../etc/passwd"  # "', 1),
        "data.train: 'pkg://hpsearch.search.presets/../../../etc/passwd' must name a file inside package "
        "hpsearch.search.presets (no '..', no leading '/')",
    ),
    (
        "pkg_of_hpsearch_itself",
        lambda s: s.replace('validation = "', 'validation = "pkg://hpsearch/../../../etc/passwd"  # "', 1),
        "data.validation: 'pkg://hpsearch/../../../etc/passwd' names package 'hpsearch'",
    ),
    # 6. missing paths are reported as missing, not as the spec's folder
    (
        "data_train_missing",
        _drop_line("train = "),
        "data.train: missing; set it to the training file's path (.jsonl, .json, .csv, .tsv, .parquet",
    ),
    (
        "data_validation_missing",
        _drop_line("validation = "),
        "data.validation: missing; set it to the validation file's path (.jsonl, .json, .csv, .tsv",
    ),
    (
        "model_name_missing",
        _drop_line("name = "),
        "model.name: missing; set it to a local model folder or a hub id",
    ),
]


@pytest.mark.parametrize("name,mutate,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_spec_value(
    cli: Cli,
    tmp_path: Path,
    tiny_model: Path,
    demo_files: tuple[Path, Path],
    name: str,
    mutate: Callable[[str], str],
    expected: str,
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(mutate(spec_text(tiny_model, *demo_files)))
    assert_refused(cli, spec, tmp_path, expected)


def test_enqueued_values_on_the_grid_and_valid_are_accepted(tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    """The new checks refuse only what is wrong: on-grid values that make a valid trial load."""
    from hpsearch.search.study.spec import StudySpec, tomllib

    text = _enqueue(LR_GRID, "learning_rate = 3e-3")(spec_text(tiny_model, *demo_files))
    text = text.replace(
        "[search.space]", '[search.space]\nbatch_size = { type = "int", low = 16, high = 64, step = 16 }'
    )
    text = text.replace("learning_rate = 3e-3", "learning_rate = 3e-3\nbatch_size = 48")
    text = text.replace("[search.space]", '[search.space]\nweight_decay = { type = "int", low = 0, high = 1 }')
    spec = StudySpec.from_dict(tomllib.loads(text))
    assert spec.enqueue == [{"learning_rate": 3e-3, "batch_size": 48}]


def test_config_that_is_a_folder(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    line = assert_refused(cli, folder, tmp_path, f"spec file {folder} is a folder, not a spec file")
    assert line == (
        f"hpsearch start: error: spec file {folder} is a folder, not a spec file; "
        "pass --config with the path of a .toml spec"
    )
