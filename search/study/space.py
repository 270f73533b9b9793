"""The search space: each searched parameter, the values it may take, and the [[search.enqueue]] sets tried first."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from hpsearch.search.errors import SpecError
from hpsearch.trainer.config import describe, fits, near

MAX_CHECKED_VALUES = 10_000
MAX_GRID_POINTS = 100_000
"""A grid larger than this is refused: no search runs that many trials, and listing it costs memory."""
ADAPTER_PREFIX = "adapter."
"""A searched [adapter] key is named "adapter.KEY" in [search.space] and in a trial's parameters."""


def split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trial's parameters as ([train] values, [adapter] values), the prefix taken off the latter."""
    train = {k: v for k, v in params.items() if not k.startswith(ADAPTER_PREFIX)}
    adapter = {k[len(ADAPTER_PREFIX) :]: v for k, v in params.items() if k.startswith(ADAPTER_PREFIX)}
    return train, adapter


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
                raise SpecError(f"{where}.{key}: unknown key; {near(key, known, 'known keys')}")
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
            if not _finite_number(value):
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
            number = _finite_number(step)
            if kind == "int" and not (number and step >= 1 and float(step).is_integer()):
                raise SpecError(f'{where}.step: {toml_text(step)} must be an integer >= 1 for type = "int"')
            if not (number and step > 0):
                raise SpecError(f"{where}.step: {toml_text(step)} must be a finite number > 0")
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
                raise SpecError(
                    f"{where}: {value!r} is not on the search grid (low + a multiple of step {self.step:g}); "
                    f"the nearest values are {below:g} and {below + self.step:g}"
                )
        return int(value) if self.type == "int" else float(value)

    def checked_values(self) -> list[Any]:
        """The values that must each make a valid trial: every choice, every value of an int range not huge (a rule
        such as "a multiple of micro_batch_size" can fail inside a range whose ends pass), else the ends."""
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


def _finite_number(value: Any) -> bool:
    """An int or a float (TOML's true is not a number here), not inf or nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def toml_text(value: Any) -> str:
    """A value as it is written in TOML (true, "text"), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    return repr(value)


def check_type_fits(param: Param, hint: Any, table: str = "train") -> None:
    """The parameter's values must be of the [train] field's type as they are: the worker puts the sampled value
    into TrainConfig unconverted (a float batch_size would reach the trainer)."""
    where, kind = f"search.space.{param.name}", describe(hint)
    field_name = param.name.removeprefix(ADAPTER_PREFIX)
    if param.type == "categorical":
        for choice in param.choices or []:
            if not fits(choice, hint):
                raise SpecError(f"{where}: choice {choice!r} does not fit {table}.{field_name}, which takes {kind}")
        return
    if fits(1.5 if param.type == "float" else 1, hint):
        return
    int_fix = 'use type = "int" (low, high, optional step) or type = "categorical" with integer choices'
    fix = int_fix if fits(1, hint) else 'use type = "categorical" with choices'
    raise SpecError(f'{where}: type = "{param.type}" does not fit {table}.{field_name}, which takes {kind}; {fix}')


def parse_enqueue(raw: Any, space: dict[str, Param]) -> list[dict[str, Any]]:
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
