"""The study spec: a TOML file (or a built-in preset) that says what to train and what to search, stored with the
study so a worker needs only its name and the storage URL. [search] is search_config.py, [search.space] space.py."""

from __future__ import annotations

import difflib
import itertools
import json
import sys
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, as a backport
    import tomli as tomllib

from hpsearch.search.errors import SpecError
from hpsearch.search.presets import BUILTIN_MODELS, BUILTIN_SCHEME, check_path, check_reference, relative_to
from hpsearch.search.study.search_config import SearchConfig
from hpsearch.search.study.space import (
    ADAPTER_PREFIX,
    MAX_CHECKED_VALUES,
    MAX_GRID_POINTS,
    Param,
    check_type_fits,
    parse_enqueue,
    split_params,
    toml_text,
)
from hpsearch.storage import attrs, urls
from hpsearch.storage.shown import shown
from hpsearch.trainer.config import (
    TASK_METRICS,
    AdapterConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    near,
)

# Values that may change between runs of one study: raising the budget is not a new study.
BUDGET_KEYS = ("n_trials", "timeout_minutes", "gpu_hours", "keep_top_k", "max_disk_gb", "budget")
MONEY_KEYS = ("price_per_gpu_hour", "currency")
"""What a device hour costs may change between runs too: the price is not what is searched."""
UNSEARCHABLE = {
    "devices_per_trial": "the workers' device groups are fixed when they start; set it in [train]",
    "sharding": "it decides how a worker's device group holds the model, fixed when it starts; set it in [train]",
}
LORA_LEARNING_RATE = 5e-4
"""train.learning_rate of a LoRA spec that gives none, 10x the full fine-tune's default (5e-5): docs/decisions.md,
"LoRA trains at 10x the full fine-tune's learning rate by default"."""
LORA_LEARNING_RATES = Param("learning_rate", "float", low=1e-4, high=1e-3, log=True)
"""What a LoRA study searches when neither [train] nor [search.space] gives a learning rate: the published optimum
for 0.5B-8B models, about 10x the full fine-tune's and nearly independent of the rank (docs/decisions.md, "A LoRA
study searches 1e-4..1e-3 by default")."""


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
    defaults_added: list[str] = field(default_factory=list, compare=False)
    """What the spec file left out and hpsearch chose, one line each, said at `start` (not stored: the stored spec
    holds the choice itself)."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: Path | None = None) -> StudySpec:
        allowed = {"model", "data", "train", "search", "adapter"}
        if not isinstance(raw, dict):
            raise SpecError("spec: must be a table with [model], [data], [train] and [search]")
        for key, value in raw.items():
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.75)
                said = (
                    f"did you mean [{close[0]}]?"
                    if close
                    else "a spec has [model], [data], [train], [adapter] and [search]"
                )
                raise SpecError(f"{key}: unknown table; {said}")
            if not isinstance(value, dict):
                raise SpecError(
                    f"{key}: must be a table, written [{key}] on a line of its own with its keys below it; "
                    f"got {key} = {toml_text(value)}"
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
        defaults_added = _add_lora_learning_rates(space, adapter, search, raw.get("train", {}))
        enqueue = parse_enqueue(enqueue_raw, space)
        if base_dir is not None:
            # Empty values stay empty (not the spec's folder), so validate() says they are missing.
            train_file = relative_to(data.train, base_dir, "data.train")
            validation_file = relative_to(data.validation, base_dir, "data.validation")
            dataset = relative_to(data.dataset, base_dir, "data.dataset", hub=True)  # a folder, or a hub dataset id
            data = replace(data, train=train_file, validation=validation_file, dataset=dataset)
            model = replace(model, name=relative_to(model.name, base_dir, "model.name", hub=True))
        if adapter.enabled and "learning_rate" not in raw.get("train", {}):
            train = replace(train, learning_rate=LORA_LEARNING_RATE)
        spec = cls(model, data, train, search, space, enqueue, adapter, defaults_added)
        spec.validate()
        return spec

    def _validate_task(self) -> None:
        """The metric is one the task records; the data keys a task reads are not set for one that ignores them."""
        task, metric = self.model.task, self.search.quality
        if task == "causal-lm" and metric != "loss":
            raise SpecError(
                f'search.metric: {metric!r} is not defined for model.task = "causal-lm"; use '
                'metric = "loss" (the validation perplexity is recorded too, as best_val_perplexity)'
            )
        if metric not in TASK_METRICS[task]:
            raise SpecError(
                f"search.metric: {metric!r} is not recorded for model.task = {task!r}; use one of "
                f"{', '.join(TASK_METRICS[task])} (docs/tasks.md)"
            )
        if self.data.text_pair_column != "" and task not in ("classification", "regression"):
            raise SpecError(
                f"data.text_pair_column: sentence pairs are for classification and regression, not {task!r}; remove it"
            )
        if self.data.label_separator and task != "multi-label":
            raise SpecError(f'data.label_separator: cuts multi-label labels only; remove it for model.task = "{task}"')

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
        self.search.check_steps(self.train)
        self._validate_sampler()
        self._validate_task()
        if self.model.name.startswith(BUILTIN_SCHEME) and self.model.name[len(BUILTIN_SCHEME) :] not in BUILTIN_MODELS:
            raise SpecError(
                f"model.name: {self.model.name!r} is not a built-in model; built-in: "
                + ", ".join(BUILTIN_SCHEME + m for m in BUILTIN_MODELS)
            )
        # A stored spec is input too (docs/decisions.md, "A worker runs the spec it was started with"): its paths
        # are checked as a spec file's are, before any file call.
        paths = {
            "model.name": self.model.name,
            "data.train": self.data.train,
            "data.validation": self.data.validation,
            "data.dataset": self.data.dataset,
        }
        for where, value in paths.items():
            check_reference(value, where)
            check_path(value, where)
        train_keys = {f.name for f in fields(TrainConfig)} - set(UNSEARCHABLE)
        hints = typing.get_type_hints(TrainConfig)
        checked: dict[str, list[Any]] = {}
        for name, param in self.space.items():
            if name.startswith(ADAPTER_PREFIX):
                self._check_adapter_param(param)
            elif name in UNSEARCHABLE:
                raise SpecError(f"search.space.{name}: cannot be searched: {UNSEARCHABLE[name]}")
            elif name not in train_keys:
                raise SpecError(f"search.space.{name}: not a [train] key; {near(name, train_keys, 'searchable keys')}")
            else:
                check_type_fits(param, hints[name])
            # Every checked value must make a valid trial, or trials would fail at run time.
            checked[name] = param.checked_values()
            for value in checked[name]:
                self.check_trial({name: value}, f"search.space.{name}: value {value!r}")
        # ... and so must every pair: batch_size 16 and micro_batch_size 32 are each fine alone.
        for a, b in itertools.combinations(checked, 2):
            if len(checked[a]) * len(checked[b]) > MAX_CHECKED_VALUES:
                continue  # the trainer still checks each trial's values when it starts
            for va, vb in itertools.product(checked[a], checked[b]):
                self.check_trial({a: va, b: vb}, f"search.space: {a} = {va!r} with {b} = {vb!r}")
        # An enqueued trial runs with exactly these values over [train]: it must be a valid trial.
        for i, entry in enumerate(self.enqueue):
            try:
                train_values, adapter_values = split_params(entry)
                replace(self.train, **train_values).validate()
                replace(self.adapter, **adapter_values).validate()
            except ConfigError as exc:
                values = ", ".join(f"{k} = {v!r}" for k, v in entry.items())
                raise SpecError(f"search.enqueue[{i}]: {values} gives an invalid trial: {exc}") from None

    def check_trial(self, values: dict[str, Any], where: str) -> None:
        """Raise SpecError, naming ``where``, unless these parameter values over [train] and [adapter] make a valid
        trial."""
        try:
            train_values, adapter_values = split_params(values)
            train = from_dict(TrainConfig, {**asdict(self.train), **train_values}, "train")
            train.validate()
            from_dict(AdapterConfig, {**asdict(self.adapter), **adapter_values}, "adapter").validate()
            self.search.check_steps(train)
        except ConfigError as exc:  # SpecError among them
            raise SpecError(f"{where} gives an invalid trial: {exc}") from None

    def _validate_adapter(self) -> None:
        """What [adapter] needs of the rest of the spec."""
        method_searched = f"{ADAPTER_PREFIX}method" in self.space
        if self.model.quantization != "none" and (self.adapter.method != "lora" or method_searched):
            raise SpecError(
                f'model.quantization: {self.model.quantization!r} needs [adapter] method = "lora" (QLoRA: a '
                'quantized base cannot be fine-tuned in full); set it, or quantization = "none"'
            )
        if self.model.quantization != "none" and self.train.sharding != "none":
            # bitsandbytes#1945, accelerate#3983: FSDP2 shards the packed 4-bit bytes as if they were weights.
            raise SpecError(
                f'train.sharding: "fsdp" with model.quantization = {self.model.quantization!r} (QLoRA) is refused: '
                'sharding quantized weights corrupts them today; use quantization = "none" with LoRA and fsdp'
            )
        sharded = self.train.sharding != "none"
        if (self.adapter.enabled or method_searched) and self.train.devices_per_trial > 1 and not sharded:
            raise SpecError(
                f"train.devices_per_trial: {self.train.devices_per_trial} is not supported with [adapter] yet; "
                "set it to 1 (an adapter trial fits one device far more often than a full fine-tune), or shard the "
                'frozen base with sharding = "fsdp"'
            )
        searched = [n for n in self.space if n.startswith(ADAPTER_PREFIX)]
        if searched and not (self.adapter.enabled or method_searched):
            raise SpecError(
                f'search.space.{searched[0]}: searched, but [adapter] method is "none" (full fine-tune); '
                'set method = "lora" in [adapter]'
            )

    def _check_adapter_param(self, param: Param) -> None:
        """An "adapter.KEY" parameter: a known key, of its type (its values are checked as [train]'s are)."""
        key = param.name[len(ADAPTER_PREFIX) :]
        keys = {f.name for f in fields(AdapterConfig)}
        if key not in keys:
            said = near(param.name, [ADAPTER_PREFIX + k for k in keys], "searchable adapter keys")
            raise SpecError(f"search.space.{param.name}: not an [adapter] key; {said}")
        check_type_fits(param, typing.get_type_hints(AdapterConfig)[key], table="adapter")

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
        """The spec as one short user attribute per table ("spec: search" = "n_trials = 20, ..."), for the dashboard,
        where the stored spec (``attrs.SPEC``) is one long JSON string."""
        d = self.to_dict()
        # Shown to anyone who opens the dashboard: a URL as urls.mask prints it (a warm start's holds no password,
        # search_config.check_warm_start refuses one; this keeps it so should that check ever change).
        d["search"]["warm_start"] = urls.mask(d["search"]["warm_start"])
        space = d["search"].pop("space")
        d["search"].pop("enqueue", None)
        out = {
            f"{attrs.SPEC_TABLE}{table}": ", ".join(f"{k} = {toml_text(v)}" for k, v in d[table].items()) for table in d
        }
        out[f"{attrs.SPEC_TABLE}search.space"] = "; ".join(
            f"{name} = {{ {', '.join(f'{k} = {toml_text(v)}' for k, v in p.items())} }}" for name, p in space.items()
        )
        return out

    @property
    def metric_names(self) -> list[str]:
        """The objectives as Optuna's metric names, which the dashboard shows on its axes."""
        return [f"val_{self.search.quality}", *([self.search.cost] if self.search.cost else [])]

    def identity(self) -> dict[str, Any]:
        """The spec without its budget: two runs of one study must agree on this."""
        d = json.loads(json.dumps(self.to_dict()))
        for key in BUDGET_KEYS + MONEY_KEYS:
            d["search"].pop(key, None)
        return d

    @property
    def searches_rank(self) -> bool:
        """Whether the LoRA rank is searched: its trials are judged late (workers/early_stop.py rank_judged_from)."""
        return f"{ADAPTER_PREFIX}r" in self.space

    @property
    def direction(self) -> str:
        """The quality objective's direction (the only one in a single-objective study)."""
        return "minimize" if self.search.quality == "loss" else "maximize"

    @property
    def directions(self) -> list[str]:
        """Every objective's direction, as Optuna's study takes them: a cost is minimised."""
        return [self.direction, *(["minimize"] if self.search.cost else [])]


def _add_lora_learning_rates(
    space: dict[str, Param], adapter: AdapterConfig, search: SearchConfig, train_raw: dict[str, Any]
) -> list[str]:
    """A LoRA study that gives no learning rate anywhere searches ``LORA_LEARNING_RATES`` (added to ``space``); the
    line that says so. Not for grid, whose points are exactly what the spec lists (it trains at the fixed default)."""
    if not adapter.enabled or "learning_rate" in space or "learning_rate" in train_raw or search.sampler == "grid":
        return []
    space["learning_rate"] = replace(LORA_LEARNING_RATES)
    span = f"{LORA_LEARNING_RATES.low:.0e}..{LORA_LEARNING_RATES.high:.0e}".replace("e-0", "e-")
    return [
        f"search.space.learning_rate: none given for a LoRA study; searching {span} (log), the "
        "published optimum for 0.5B-8B models (docs/decisions.md); give learning_rate in [train] or [search.space] "
        "to choose"
    ]


def difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str | None:
    """The first key path where the stored spec dict ``a`` and the given one ``b`` differ, with both values (a stored
    spec is a database row: its values are escaped and cut, as is the key path)."""
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            if found := difference(va, vb, path + "."):
                return found
        elif va != vb:
            return f"{shown(path)}: stored {shown(repr(va))}, given {shown(repr(vb))}"
    return None


def load_file(path: Path) -> StudySpec:
    try:
        kind = "folder" if path.is_dir() else "file" if path.is_file() else "other" if path.exists() else "missing"
    except OSError as exc:  # a name too long for the file system, a folder we may not enter
        raise SpecError(f"spec file {path} cannot be read ({exc.strerror or exc}); fix the --config path") from None
    if kind != "file":
        what = {"folder": "is a folder, not a spec file", "other": "is not a regular file (a pipe or a device)"}
        why = what.get(kind, "does not exist")
        raise SpecError(f"spec file {path} {why}; pass --config with the path of a .toml spec")
    try:
        # utf-8-sig: Windows editors save a byte-order mark that TOML would call an invalid statement.
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec file {path} is not valid TOML: {exc}") from None
    except RecursionError:  # a = [[[[... thousands deep: the parser recurses once a level
        raise SpecError(f"spec file {path} nests arrays or tables too deeply to be a spec") from None
    except UnicodeDecodeError:
        raise SpecError(f"spec file {path} is not UTF-8 text; re-save it as UTF-8") from None
    except OSError as exc:
        raise SpecError(f"spec file {path} cannot be read ({exc.strerror or exc}); fix its permissions") from None
    try:
        return StudySpec.from_dict(raw, base_dir=path.parent.resolve())
    except RecursionError:  # a value nested a little less deeply than the parser's limit, printed in a message
        raise SpecError(f"spec file {path} nests arrays or tables too deeply to be a spec") from None
