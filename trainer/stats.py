"""Honest throughput and memory figures of a fine-tune."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch


class Throughput:
    """Counts training examples and real (unpadded) tokens against training time only."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.examples = 0
        self.tokens = 0
        self.seconds = 0.0
        self._t0 = 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def resume(self) -> None:
        """Start (or keep) the training clock; idempotent."""
        if self._t0 == 0.0:
            self._t0 = time.perf_counter()

    def pause(self) -> None:
        """Stop the clock; call right after a host sync (``.item()``) so queued GPU work is counted."""
        if self._t0:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = 0.0

    def add(self, *, examples: int, tokens: int) -> None:
        self.examples += examples
        self.tokens += tokens

    def attrs(self) -> dict[str, Any]:
        secs = max(self.seconds, 1e-9)
        return {
            "train_samples_per_second": round(self.examples / secs, 2),
            "train_tokens_per_second": round(self.tokens / secs, 1),
            "train_seconds": round(self.seconds, 2),
            "train_samples": self.examples,
            "peak_memory_mb": round(peak_memory_mb(self.device), 1),
        }


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: the process's peak resident set; KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
