"""Per-trial training curves as TensorBoard event files, written with tensorboardX (docs/watching.md).

A curve must never stop a fine-tune: the first I/O error disables the writer with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from hpsearch.storage import regular
from hpsearch.trainer.stats import Throughput, peak_memory_mb

log = logging.getLogger(__name__)


class Curves:
    """Writes one trial's curves to ``<folder>/events.out.tfevents.*``."""

    def __init__(self, folder: Path, device: torch.device, *, enabled: bool = True) -> None:
        self.device = device
        # The event files' folder; None once disabled, and on data-parallel ranks other than 0 (one curve per trial).
        self.path: Path | None = folder if enabled else None
        self._writer: Any = None
        self._last_examples, self._last_seconds = 0, 0.0
        if not enabled:
            return
        try:
            regular.check_unmoved(folder)  # never into an output folder swapped for a link since start
            folder.mkdir(parents=True, exist_ok=True)
            from tensorboardX import SummaryWriter

            # One file per attempt (the suffix tells two attempts of one second apart): a resumed
            # trial continues the same curve in a second file, which TensorBoard merges by step.
            self._writer = SummaryWriter(str(folder), filename_suffix=f".{os.getpid()}.{id(self)}")
        except OSError as exc:
            self._disable(exc)

    def train(self, step: int, *, loss: float, lr: float, speed: Throughput) -> None:
        """A validation point: mean train loss since the last one, learning rate, throughput, memory."""
        examples, seconds = speed.examples - self._last_examples, speed.seconds - self._last_seconds
        self._last_examples, self._last_seconds = speed.examples, speed.seconds
        scalars = {"train/loss": loss, "train/learning_rate": lr}
        if seconds > 0:
            scalars["train/samples_per_second"] = examples / seconds
        self.write(step, scalars | self._memory())

    def validation(self, step: int, metrics: Any) -> None:
        self.write(step, {f"validation/{name}": value for name, value in metrics.values().items()})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            return
        try:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, float(value), step)
            # At validation points only (a few a minute): flushed each time, so a trial that dies keeps its curve.
            self._writer.flush()
        except OSError as exc:
            self._disable(exc)

    def _memory(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {
                "memory/allocated_mb": torch.cuda.memory_allocated(self.device) / 2**20,
                "memory/reserved_mb": torch.cuda.memory_reserved(self.device) / 2**20,
                "memory/peak_mb": peak_memory_mb(self.device),
            }
        return {"memory/rss_mb": _rss_mb(), "memory/peak_mb": peak_memory_mb(self.device)}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _disable(self, exc: OSError) -> None:
        log.warning("training curves disabled for this trial: %s", exc)
        self.path = None
        self._writer = None


def _rss_mb() -> float:
    """Current resident memory (not the peak), from /proc where it exists."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
