"""What a run has reached (step, best point, micro-batch), and its resumable state on disk."""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpsearch.trainer import adapters, checkpoint as ckpt, sharding
from hpsearch.trainer.batching import smaller_micro
from hpsearch.trainer.distributed import World
from hpsearch.trainer.evaluate import Point

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything of a run that changes as it trains, but the weights and optimizer moments."""

    step: int = 0  # optimizer steps taken: the step reported to the search, never a micro-batch index
    best: Point | None = None
    micro: int = 1  # the micro-batch size: halved when a step runs out of memory, and kept so on resume
    resumed_from: int | None = None  # the step of the resumable state continued from; None for a fresh run
    best_values: dict[str, float] | None = None  # ``best``'s metrics by name, when restored from the best model's meta


@dataclass
class Trainable:
    """The objects a resumable state restores: the plain model, optimizer, scheduler, scaler."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    files: ckpt.RunFiles
    config: dict[str, Any]
    world: World = field(default_factory=World)

    @property
    def sharded(self) -> bool:
        return sharding.is_sharded(self.model)

    def save(self, state: TrainState) -> Path:
        """Write the resumable state (rank 0; a sharded model's every rank, each its own part) and return its path."""
        if self.sharded:
            return self._save_sharded(state)
        if not self.world.is_main:  # data parallel: the ranks' states are equal, rank 0's is written
            return self.files.state
        # The plain module: no DDP / compile prefixes. Of an adapter, only what it trains.
        model = adapters.trainable_state(self.model) if adapters.is_adapter(self.model) else self.model.state_dict()
        return ckpt.save_resume(
            self.files.state, {"model": model, "optimizer": self.optimizer.state_dict(), **self._plain(state)}
        )

    def _plain(self, state: TrainState) -> dict[str, Any]:
        """Everything of the state but the weights and optimizer moments."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": state.step,
            "best_step": state.best.step if state.best else None,
            "config": self.config,
            "micro_batch_size": state.micro,
        }

    def _save_sharded(self, state: TrainState) -> Path:
        """Every rank writes its shards into one new folder, rank 0 the rest (state.pt) and then swaps the folder in:
        a crash of any rank before the swap leaves the previous state whole."""
        target, world = self.files.state.parent, self.world
        made: str | None = None
        if world.is_main:
            try:
                made = str(ckpt.temp_dir(target))
            except OSError as exc:  # said to every rank below: none may wait in the save's collectives
                made = f"!{exc}"
        shared = world.gather(made)[0]
        if shared.startswith("!"):
            raise ckpt.save_failed(target, OSError(shared[1:]))
        tmp = Path(shared)
        trained_only = adapters.is_adapter(self.model)
        try:
            groups = sharding.save_shards(self.model, self.optimizer, tmp / sharding.SHARDS, trained_only=trained_only)
            if world.is_main:
                rest = {**self._plain(state), "optimizer_groups": groups, "sharded": world.size}
                ckpt.save_resume(tmp / self.files.state.name, rest, atomic=False)
                ckpt.swap_in(tmp, target)
        except Exception as exc:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt.save_failed(target, exc) from exc
        return self.files.state

    def restore(self, path: Path | None, metric: str, micro: int) -> TrainState:
        """The state to start from: ``path``'s, or a fresh one where there is none (or it is unreadable). Its
        micro-batch is smaller than the one a rank of a previous attempt ran out of memory at, if one did."""
        ran_out = ckpt.out_of_memory_at(self.files.out_of_memory)
        if ran_out is not None:
            micro = min(micro, smaller_micro(ran_out) or 1)
            log.warning("a previous attempt ran out of memory at micro-batch %d: this one uses %d", ran_out, micro)
        if path is None:
            return TrainState(micro=micro)
        try:
            saved = ckpt.load_resume(path)
            readable = self.sharded == ("sharded" in saved) and saved.get("sharded", self.world.size) == self.world.size
        except Exception as exc:  # truncated zip, refused types, missing file: must not cost the trial
            log.warning("cannot read the resumable state %s (%s)", path, exc)
            readable = False
        # A sharded state is loaded by every rank together: they all load it, or none does.
        if self.sharded and not all(self.world.gather(readable)):
            readable = False
        if not readable:
            log.warning("the resumable state %s is not usable here; training from the start", path)
            return TrainState(micro=micro)
        if self.sharded:
            shards, trained_only = path.parent / sharding.SHARDS, adapters.is_adapter(self.model)
            groups = saved["optimizer_groups"]
            sharding.load_shards(self.model, self.optimizer, shards, groups, trained_only=trained_only)
        elif adapters.is_adapter(self.model):
            adapters.load_trainable(self.model, saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
        else:
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        ckpt.set_rng_state(saved["rng"])
        # A micro-batch that ran out of memory before the restart would do so again.
        saved_micro = saved.get("micro_batch_size")
        if isinstance(saved_micro, int):
            micro = min(micro, saved_micro)
        log.info("resumed from %s at optimizer step %d", path, saved["step"])
        best, values = restored_best(self.files.best, metric, saved["best_step"])
        return TrainState(saved["step"], best, micro, saved["step"], values)


def restored_best(best: Path, metric: str, saved_step: int | None) -> tuple[Point | None, dict[str, float] | None]:
    """The best point a resumed run starts from, and its metrics, from the meta of the model in the run's
    folder, not from the resumable state: that may be older than the last best model, and a best point
    whose model is gone would leave the trial a value no checkpoint has (then the best starts over)."""
    meta = ckpt.best_meta(best) or {}
    value, step = meta.get(f"val_{metric}"), meta.get("step")
    if not isinstance(value, int | float) or not isinstance(step, int):
        if saved_step is not None:
            log.warning("the best model of step %d is not in %s: the best point starts over", saved_step, best)
        return None, None
    loss = meta.get("val_loss")
    values = {k.removeprefix("val_"): v for k, v in meta.items() if k.startswith("val_")}  # as _meta() wrote them
    return Point(float(value), float(loss) if isinstance(loss, int | float) else math.inf, step), values
