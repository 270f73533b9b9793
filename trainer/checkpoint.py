"""Writing checkpoints atomically: the best model (for users) and resumable state (for us)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpsearch.storage import regular
from hpsearch.trainer.errors import is_disk_full
from hpsearch.trainer.model import unwrap
from hpsearch.trainer.report import FailReason

log = logging.getLogger(__name__)
META = "hpsearch.json"  # beside the best model: the study, trial, step, validation metrics and training config
MAX_RECORD_BYTES = 2**20  # a meta or out-of-memory record of ours is a few hundred bytes: a larger one is not ours


@dataclass(frozen=True)
class RunFiles:
    """Where one run writes. The owner of the run's folder hands them over (for a trial,
    storage/trialdir.py's ``TrialDir``), so the trainer names no file or folder of its own."""

    best: Path  # the best model's folder, replaced whole at each new best point
    state: Path  # the resumable state's file; its folder is replaced whole at each save
    curves: Path  # the folder of the TensorBoard event files
    # Where a rank of a multi-device trial records the micro-batch it ran out of memory at (beside ``state``: a retry
    # takes it over with the resumable state, and a finished trial's goes with it).
    out_of_memory: Path


class CheckpointError(OSError):
    """Saving a checkpoint failed; ``reason`` is recorded on the trial."""

    def __init__(self, message: str, reason: FailReason) -> None:
        super().__init__(message)
        self.reason = reason


def save_best(
    model: torch.nn.Module,
    tokenizer: Any,
    target: Path,
    meta: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    mode: int | None = None,
) -> Path:
    """Save model + tokenizer to ``target``, loadable with ``from_pretrained``; replaces the previous best.
    ``state_dict``: the weights to write, when the model's own are shards (trainer/sharding.py ``full_state``).
    ``dtype``: the checkpoint's own dtype (trainer/precision.py ``Policy.stored``): fp32 masters of a bf16 model
    are saved in bf16, so the best folder is as big as the model it came from. An adapter folder keeps its fp32
    adapter (peft's own default; a few MB). ``mode``: the files' permissions, no wider than the data's (its label
    names are in config.json; encoding.py ``Prepared.mode``); None leaves the umask's."""

    def write(tmp: Path) -> None:
        plain = unwrap(model)
        full = not hasattr(plain, "peft_config")
        weights = state_dict
        if full and dtype is not None and any(_needs_cast(t, dtype) for t in _values(plain, state_dict)):
            weights = _cast(state_dict if state_dict is not None else plain.state_dict(), dtype)
        plain.save_pretrained(tmp, safe_serialization=True, state_dict=weights)  # None: the model's own
        if state_dict is not None:
            _name_unsharded_class(plain, tmp)
        if weights is not state_dict and dtype is not None:
            _name_dtype(tmp, dtype)
        tokenizer.save_pretrained(tmp)
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if mode is not None:
            for file in tmp.rglob("*"):
                if file.is_file() and not file.is_symlink():
                    file.chmod(mode)

    _atomic_dir(target, write)
    return target


def _values(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None) -> Any:
    return state_dict.values() if state_dict is not None else (p for p in model.parameters())


def _needs_cast(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.is_floating_point() and tensor.dtype != dtype


def _cast(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state_dict``'s floating tensors in ``dtype``; one copy per storage, so tied weights (a head that is the
    embedding) stay one tensor and save_pretrained still sees them tied."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in state_dict.items():
        if not _needs_cast(tensor, dtype):
            out[name] = tensor
            continue
        key = tensor.data_ptr()
        if key not in copies:
            copies[key] = tensor.detach().to(dtype)
        out[name] = copies[key]
    return out


def _name_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the model was trained in (fp32 masters); write the one its weights are in."""
    config = folder / "config.json"
    if not config.exists():
        return
    values = json.loads(config.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in values or key == "dtype":
            values[key] = name
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _name_unsharded_class(model: torch.nn.Module, folder: Path) -> None:
    """FSDP2 gives a sharded module a class of its own (FSDPGPT2LMHeadModel, a subclass of FSDPModule and the
    model's class), and transformers records the class name in config.json's ``architectures``: write the model's
    real class there, as an unsharded save would."""
    from torch.distributed.fsdp import FSDPModule

    config = folder / "config.json"
    if not config.exists():  # an adapter folder: adapter_config.json names its base by path
        return
    real = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    values = json.loads(config.read_text())
    values["architectures"] = [real.__name__]
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def best_meta(best: Path) -> dict[str, Any] | None:
    """The meta of the best model in ``best``, or None if there is none (or it is unreadable)."""
    try:
        meta = json.loads(regular.read_text(best / META, MAX_RECORD_BYTES))
    except (OSError, ValueError):  # NotRegularFile among them: a FIFO or link put there is no meta of ours
        return None
    return meta if isinstance(meta, dict) else None


def save_resume(path: Path, state: dict[str, Any], *, atomic: bool = True) -> Path:
    """The state (and this process's RNG) to ``path``, its folder swapped in whole; ``atomic=False``: into a
    folder the caller swaps in itself (a sharded state's, which every rank writes into)."""
    state = {**state, "rng": rng_state()}
    if atomic:
        _atomic_dir(path.parent, lambda tmp: torch.save(state, tmp / path.name))
    else:
        torch.save(state, path)
    return path


def load_resume(path: Path) -> dict[str, Any]:
    """The state :func:`save_resume` wrote: ``weights_only``, never a pickle (a shared runs folder may hold a
    file someone else wrote; see docs/decisions.md, "No pickle from disk"), and only from a regular file reached
    through no link (storage/regular.py: a FIFO there would hang the worker). Its values are the caller's to check
    (trainer/state.py ``check_saved``)."""
    with regular.open_file(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_dir(target: Path, write: Callable[[Path], object]) -> None:
    """Write into a sibling temp folder, then swap it in: a crash never leaves half a checkpoint."""
    try:
        tmp = temp_dir(target)
    except OSError as exc:  # a full disk, or a folder on the way swapped for a link (storage/regular.py)
        raise save_failed(target, exc) from exc
    try:
        write(tmp)
        swap_in(tmp, target)
    except Exception as exc:  # SafetensorError is neither an OSError nor a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(target, exc) from exc


def temp_dir(target: Path) -> Path:
    """A new, empty sibling of ``target`` to write a checkpoint into (the ranks of a sharded trial share one);
    refused (NotRegularFile) where a folder on the way became a link since the output folder was resolved."""
    regular.check_unmoved(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def swap_in(tmp: Path, target: Path) -> None:
    """Replace ``target`` with the complete ``tmp``: two renames, so a reader sees the old folder or the new one."""
    regular.check_unmoved(target)  # the old one is deleted: never through a folder swapped for a link
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    regular.remove(old)  # through no folder that became a link after the check above


def save_failed(target: Path, exc: BaseException) -> CheckpointError:
    # torch.save reports a full disk as a RuntimeError from its zip writer ("file write failed").
    full = is_disk_full(exc) or (isinstance(exc, RuntimeError) and "file write failed" in str(exc))
    reason = FailReason.DISK_FULL if full else FailReason.CHECKPOINT_ERROR
    return CheckpointError(f"cannot save checkpoint {target}: {exc}", reason)


def record_out_of_memory(path: Path, micro: int, step: int, rank: int) -> None:
    """Write that ``rank`` ran out of memory at ``micro`` (JSON, replaced atomically: two ranks may both write; the
    rename replaces whatever was planted at ``path``, a FIFO or a link, rather than writing through it)."""
    regular.check_unmoved(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with regular.create_new(tmp, 0o644) as f:
        f.write(json.dumps({"micro_batch_size": micro, "step": step, "rank": rank}))
    os.replace(tmp, path)


def out_of_memory_at(path: Path) -> int | None:
    """The micro-batch a previous attempt ran out of memory at, if one recorded it (JSON: nothing is unpickled; a
    FIFO, link or oversized file there is ignored with a warning, never waited on)."""
    try:
        micro = json.loads(regular.read_text(path, MAX_RECORD_BYTES)).get("micro_batch_size")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring the out-of-memory record %s: %s", path, exc)
        return None
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        log.warning("ignoring the out-of-memory record %s: micro_batch_size %r", path, micro)
        return None
    return micro
