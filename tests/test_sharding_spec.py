"""train.sharding in the spec: what is refused (exit 2, one line, no storage made) and what is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Cli, assert_refused, spec_text

QLORA = '[adapter]\nmethod = "lora"\n[model]\nquantization = "4bit"\n'


def _with(tiny_model: Path, demo_files: tuple[Path, Path], train: str, tail: str = "") -> str:
    text = spec_text(tiny_model, *demo_files, extra_train=train)
    if tail:
        # A second [model] table is not TOML: fold quantization into the first one.
        text = text.replace("max_length = 32", 'max_length = 32\nquantization = "4bit"')
        text += '[adapter]\nmethod = "lora"\n'
    return text


@pytest.mark.parametrize(
    "train,tail,expected",
    [
        ('sharding = "fsdp"', "", "train.sharding: 'fsdp' needs devices_per_trial >= 2 (it is 1)"),
        (
            'sharding = "fsdp"\ndevices_per_trial = 2',
            QLORA,
            "train.sharding: \"fsdp\" with model.quantization = '4bit' (QLoRA) is refused",
        ),
        ('sharding = "zero3"', "", "train.sharding: 'zero3' must be one of 'none', 'fsdp'"),
        ("sharding = 1", "", "train.sharding: 1 must be one of 'none', 'fsdp'"),
    ],
    ids=["one_device", "qlora", "unknown", "wrong_type"],
)
def test_bad_sharding_is_refused_in_one_line(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], train: str, tail: str, expected: str
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(_with(tiny_model, demo_files, train, tail))
    assert_refused(cli, spec, tmp_path, expected, devices="cpu:2")


def test_sharding_cannot_be_searched(cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    spec = tmp_path / "bad.toml"
    text = spec_text(tiny_model, *demo_files, extra_train="devices_per_trial = 2")
    spec.write_text(
        text.replace(
            "[search.space]", '[search.space]\nsharding = { type = "categorical", choices = ["none", "fsdp"] }'
        )
    )
    assert_refused(cli, spec, tmp_path, "search.space.sharding: cannot be searched", devices="cpu:2")


def test_fsdp_over_two_devices_with_lora_is_a_valid_spec(tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    """The pairs that are allowed load: fsdp over 2 devices, with and without [adapter] (LoRA is refused with
    devices_per_trial > 1 only without sharding)."""
    from hpsearch.search.errors import SpecError
    from hpsearch.search.study.spec import StudySpec, tomllib

    base = spec_text(tiny_model, *demo_files, extra_train='devices_per_trial = 2\nsharding = "fsdp"')
    assert StudySpec.from_dict(tomllib.loads(base)).train.sharding == "fsdp"
    lora = StudySpec.from_dict(tomllib.loads(base + '[adapter]\nmethod = "lora"\n'))
    assert lora.adapter.enabled and lora.train.sharding == "fsdp"
    unsharded = base.replace('sharding = "fsdp"', "") + '[adapter]\nmethod = "lora"\n'
    with pytest.raises(SpecError, match="not supported with \\[adapter\\] yet"):
        StudySpec.from_dict(tomllib.loads(unsharded))
