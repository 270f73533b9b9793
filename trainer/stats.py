"""Honest throughput and memory figures of a fine-tune."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import torch

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets; the first
# name fragment found in torch.cuda.get_device_name() wins, so longer names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A30", 165.0),
    ("A40", 149.7),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L20", 119.5),
    ("L4", 121.0),
    ("RTX 4090 D", 147.0),
    ("RTX 4090", 165.2),
    ("RTX 4080", 97.5),
    ("RTX 3090", 71.0),
    ("RTX 3080", 59.5),
    ("RTX A6000", 154.8),
    ("RTX 6000 Ada", 364.0),
    ("A5000", 111.0),
    ("V100", 125.0),
    ("T4", 65.0),  # no bf16 tensor cores: their fp16 peak (what fp16 runs use)
)
PEAK_ENV = "HPSEARCH_PEAK_TFLOPS"


def peak_tflops(device_name: str) -> float | None:
    """The GPU's peak bf16/fp16 rate; ``HPSEARCH_PEAK_TFLOPS`` overrides (unlisted GPUs)."""
    override = os.environ.get(PEAK_ENV)
    if override:
        return float(override)
    return next((tflops for fragment, tflops in PEAK_BF16_TFLOPS if fragment.lower() in device_name.lower()), None)


def mfu(flops_per_token: float, tokens: int, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (both in FLOP/s)."""
    return flops_per_token * tokens / max(seconds, 1e-9) / peak


class Throughput:
    """Counts training examples and real (unpadded) tokens against training time only; on CUDA also
    ``mfu`` (see docs/speed.md): padding counts as waste, not work."""

    def __init__(self, device: torch.device, flops_per_token: float = 0.0) -> None:
        self.device, self.flops_per_token = device, flops_per_token
        self.examples = self.tokens = self.padded = 0
        self.seconds = self._t0 = 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def resume(self) -> None:  # start (or keep) the training clock
        if self._t0 == 0.0:
            self._t0 = time.perf_counter()

    def pause(self) -> None:
        """Stop the clock; call right after a host sync (``.item()``) so queued GPU work counts."""
        if self._t0:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = 0.0

    def add(self, *, examples: int, tokens: int, padded: int | None = None) -> None:
        self.examples += examples
        self.tokens += tokens
        self.padded += tokens if padded is None else padded

    def speed(self) -> Speed:
        secs = max(self.seconds, 1e-9)
        mfu_: float | None = None
        if self.device.type == "cuda" and self.flops_per_token and self.seconds > 0:
            peak = peak_tflops(torch.cuda.get_device_name(self.device))
            if peak:
                mfu_ = round(mfu(self.flops_per_token, self.tokens, self.seconds, peak * 1e12), 4)
        return Speed(
            round(self.examples / secs, 2),
            round(self.tokens / secs, 1),
            round(self.seconds, 3),
            self.examples,
            self.tokens,
            round(self.padded / max(self.tokens, 1), 3),
            round(peak_memory_mb(self.device), 1),
            mfu_,
        )


@dataclass(frozen=True)
class Speed:
    """A run's throughput and memory over its training time."""

    train_samples_per_second: float
    train_tokens_per_second: float
    train_seconds: float  # ms: short trials on fast devices last under a second
    train_samples: int
    train_tokens: int
    train_padding_ratio: float  # tokens processed per real token: 1.0 means no padding at all
    peak_memory_mb: float
    mfu: float | None = None  # CUDA only: model FLOPs utilisation


@dataclass(frozen=True)
class Figures:
    """What a run measured of itself, reported once at its end (``Reporter.measured``)."""

    speed: Speed
    precision: str
    micro_batch_size: int
    accumulation_steps: int
    compiled: bool
    trainable_parameters: int  # an adapter trains a fraction of a percent of the model: this says how much
    first_step_seconds: float | None = None  # how long the trial took to get going (model copy, data, resume)
    devices: int | None = None  # data-parallel ranks, when more than one
    rank_parameter_digests: list[str] | None = None  # equal digests: the ranks' parameters stayed identical
    sharding: str | None = None  # "fsdp" for a sharded trial (its ranks hold different parts: no digests)
    rank_held_mb: list[float] | None = None  # several ranks: parameters + optimizer state each held (its shards)
    validation_seconds: float | None = None  # spent validating, early points included (this rank's clock)
    held_mb: float | None = None
    """What training held on the device, to set beside the memory plan: on CUDA the peak allocated (weights,
    gradients, optimizer state, activations: torch.cuda.max_memory_allocated); on CPU, where the process's memory
    says nothing of the tensors, the weights and optimizer state measured from the tensors at the end plus the
    gradients (each its parameter's size and dtype; the last step's are freed by then). Rank 0's."""
    point_rows: int | None = None  # data.validation_rows: the validation rows each full point scored
    final_rows: int | None = None  # data.validation_rows: the rows the best was re-scored on for the trial's value


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: the process's peak resident set; KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
