"""What a run has reached (step, best point, micro-batch), and its resumable state on disk."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpsearch.storage import regular
from hpsearch.trainer import adapters, checkpoint as ckpt, sharded_state, sharding
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
            groups = sharded_state.save_shards(
                self.model, self.optimizer, tmp / sharded_state.SHARDS, trained_only=trained_only
            )
            if world.is_main:
                rest = {**self._plain(state), "optimizer_groups": groups, "sharded": world.size}
                ckpt.save_resume(tmp / self.files.state.name, rest, atomic=False)
                ckpt.swap_in(tmp, target)
        except Exception as exc:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt.save_failed(target, exc) from exc
        return self.files.state

    def restore(self, path: Path | None, metric: str, micro: int, total_steps: int | None = None) -> TrainState:
        """The state to start from: ``path``'s, or a fresh one where there is none, or where it is damaged (a file
        that is not one, a value out of range: a step past ``total_steps``, a tampered shard index). A damaged state
        is discarded with a warning and the run starts from step 0, every rank alike, before any rank reads a shard:
        the retry of a crash must not resume into the same crash. Its micro-batch is smaller than the one a rank of a
        previous attempt ran out of memory at, if one did."""
        ran_out = ckpt.out_of_memory_at(self.files.out_of_memory)
        if ran_out is not None:
            micro = min(micro, smaller_micro(ran_out) or 1)
            log.warning("a previous attempt ran out of memory at micro-batch %d: this one uses %d", ran_out, micro)
        if path is None:
            return TrainState(micro=micro)
        saved, problem = self._read(path, total_steps)
        # A sharded state is loaded by every rank together: they all load it, or none does.
        if self.sharded:
            problem = next((p for p in self.world.gather(problem) if p is not None), None)
        if problem is not None:
            log.warning(
                "the resumable state %s is damaged or not usable here (%s): discarded; training from step 0",
                path,
                problem,
            )
            self._discard(path)
            return TrainState(micro=micro)
        try:
            self._load(path, saved)
        except Exception as exc:
            # Some weights may be loaded already: this attempt cannot go on from them, and its retry must not read
            # the same state again.
            self._discard(path)
            raise DamagedState(
                f"the resumable state {path} could not be loaded ({exc}); discarded: the retry trains from step 0"
            ) from exc
        # A micro-batch that ran out of memory before the restart would do so again.
        saved_micro = saved.get("micro_batch_size")
        if isinstance(saved_micro, int):
            micro = min(micro, saved_micro)
        log.info("resumed from %s at optimizer step %d", path, saved["step"])
        best, values = restored_best(self.files.best, metric, saved["best_step"])
        return TrainState(saved["step"], best, micro, saved["step"], values)

    def _read(self, path: Path, total_steps: int | None) -> tuple[dict[str, Any], str | None]:
        """The saved state and, if it cannot be used, why (this rank's view; nothing is loaded into the model)."""
        try:
            saved = ckpt.load_resume(path)
            problem = check_saved(saved, total_steps, self.world.size if self.sharded else None)
            if problem is None and self.sharded:
                problem = sharded_state.check_shards(path.parent / sharded_state.SHARDS)
            elif problem is None:
                problem = _check_weights(self.model, saved["model"], adapters.is_adapter(self.model))
        except Exception as exc:  # truncated zip, refused types, a FIFO or link, missing file: must not cost the trial
            return {}, f"{type(exc).__name__}: {exc}"
        return saved, problem

    def _load(self, path: Path, saved: dict[str, Any]) -> None:
        if self.sharded:
            shards, trained_only = path.parent / sharded_state.SHARDS, adapters.is_adapter(self.model)
            groups = saved["optimizer_groups"]
            sharded_state.load_shards(self.model, self.optimizer, shards, groups, trained_only=trained_only)
        elif adapters.is_adapter(self.model):
            adapters.load_trainable(self.model, saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
        else:
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        ckpt.set_rng_state(saved["rng"])

    def _discard(self, path: Path) -> None:
        """Remove a damaged state (rank 0, once every rank has judged it), so that no retry resumes from it; the
        next save writes a new one. Never through a folder swapped for a link (storage/regular.py)."""
        if not self.world.is_main or not regular.unmoved(path):
            return
        for gone in (path, path.parent / sharded_state.SHARDS):
            with contextlib.suppress(OSError):  # opens no folder on the way through a link, follows none inside
                regular.remove(gone)


class DamagedState(RuntimeError):
    """A resumable state that passed its checks failed as it was loaded; it is discarded (the attempt fails, and its
    retry starts from step 0)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_saved(saved: Any, total_steps: int | None, world_size: int | None) -> str | None:
    """Why a saved state (as :func:`checkpoint.load_resume` read it) cannot be resumed from, or None. ``world_size``:
    the ranks of a sharded run (whose weights are in the shards), None for a plain one. The values are input (a
    shared runs folder): a step of 10**12 would mark the run complete untrained, a negative one break the loop."""
    if not isinstance(saved, dict):
        return "not a saved state"
    needed = (
        "scheduler",
        "scaler",
        "step",
        "best_step",
        "rng",
        *(("optimizer_groups",) if world_size else ("model", "optimizer")),
    )
    if missing := [k for k in needed if k not in saved]:
        return f"no {', '.join(missing)}"
    if world_size is not None and saved.get("sharded") != world_size:
        return f"saved by {saved.get('sharded')!r} ranks, not {world_size}"
    if world_size is None and "sharded" in saved:
        return "a sharded state, for a run that is not sharded"
    step, best = saved["step"], saved["best_step"]
    top = total_steps if total_steps is not None else MAX_STEP
    if not _is_int(step) or not 0 <= step <= top:
        return f"step {step!r} is not within the run's 0..{top} optimizer steps"
    if best is not None and (not _is_int(best) or not 0 <= best <= step):
        return f"best_step {best!r} is not within 0..{step}"
    micro = saved.get("micro_batch_size")
    if micro is not None and (not _is_int(micro) or micro < 1):
        return f"micro_batch_size {micro!r} is not a positive integer"
    if not all(isinstance(saved[k], dict) for k in ("scheduler", "scaler", "rng")):
        return "its scheduler, scaler or random state is not a table"
    last = saved["scheduler"].get("last_epoch", step)
    if not _is_int(last) or not -1 <= last <= top:
        return f"the scheduler's last_epoch {last!r} is not within the run's steps"
    return _check_rng(saved["rng"])


MAX_STEP = 10**9
"""Where the run's length is not known (a caller other than fit): more optimizer steps than any run takes."""


def _check_rng(rng: dict[str, Any]) -> str | None:
    """The random state set last, after the weights: checked first, on throwaway generators."""
    try:
        random.Random().setstate(rng["python"])
        torch.Generator().set_state(rng["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        return f"its random state cannot be set ({type(exc).__name__}: {exc})"
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda)):
        return "its CUDA random state is not a list of tensors"
    return None


def _check_weights(model: torch.nn.Module, weights: Any, trained_only: bool) -> str | None:
    """Whether a plain state's weights fit ``model``: the names and shapes it has (of an adapter, the trained ones
    it holds), so that loading them cannot stop half-way."""
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        return "its weights are not a table of tensors"
    own = {n: p for n, p in model.named_parameters() if p.requires_grad} if trained_only else model.state_dict()
    if set(weights) != set(own):
        extra, gone = sorted(set(weights) - set(own))[:3], sorted(set(own) - set(weights))[:3]
        return f"its weights name other parameters (unexpected {extra}, missing {gone})"
    wrong = [k for k, v in weights.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    return f"its weights have other shapes ({wrong[:3]})" if wrong else None


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
