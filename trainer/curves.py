"""Per-trial training curves as TensorBoard event files, with no TensorBoard needed to write them.

An event file is a TFRecord stream of ``Event`` protocol buffers. The few messages a scalar
needs are written here by hand (a dozen bytes of protobuf each), so training never depends
on the ``tensorboard`` package; ``tensorboard --logdir <output-dir>/<study>`` reads them.

Points are written at the loop's log points only (where the loss is read from the device
anyway), and each record is appended and flushed at once, so a crashed trial keeps its curve.
A curve must never stop a fine-tune: the first I/O error disables the writer with a warning.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import torch

from hpsearch.trainer.stats import Throughput, peak_memory_mb

log = logging.getLogger(__name__)
FOLDER = "tensorboard"
"""Sub-folder of the trial's output directory that holds its event files."""


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), TFRecord's checksum; records are tiny, so pure Python is fine."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """Frame one record: length, its checksum, the data, its checksum."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 fields are encoded as unsigned 64-bit
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event(
    wall_time: float,
    *,
    step: int = 0,
    scalars: dict[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """Serialise a tensorflow ``Event``: wall_time=1 (double), step=2, file_version=3, summary=5."""
    out = bytearray(_varint(1 << 3 | 1) + struct.pack("<d", wall_time))
    if step:
        out += _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        # Summary.value=1 -> Value{tag=1 (string), simple_value=2 (float)}
        values = b"".join(
            _length_delimited(
                1,
                _length_delimited(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value),
            )
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return bytes(out)


class Curves:
    """Writes one trial's curves to ``<out_dir>/tensorboard/events.out.tfevents.*``."""

    def __init__(self, out_dir: Path, device: torch.device, *, enabled: bool = True) -> None:
        self.device = device
        folder = out_dir / FOLDER
        # One file per attempt: a resumed trial continues the same curve in a second file,
        # which TensorBoard merges by step.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path: Path | None = folder / f"{name}.{id(self)}"
        self._last_examples = 0
        self._last_seconds = 0.0
        if not enabled:  # data-parallel ranks other than 0: one curve per trial
            self.path = None
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._disable(exc)
            return
        self._append(event(time.time(), file_version="brain.Event:2"))

    def train(self, step: int, *, loss: float, lr: float, speed: Throughput) -> None:
        """A log point: mean train loss since the last one, learning rate, throughput, memory."""
        examples, seconds = speed.examples - self._last_examples, speed.seconds - self._last_seconds
        self._last_examples, self._last_seconds = speed.examples, speed.seconds
        scalars = {"train/loss": loss, "train/learning_rate": lr}
        if seconds > 0:
            scalars["train/samples_per_second"] = examples / seconds
        scalars.update(self._memory())
        self.write(step, scalars)

    def validation(self, step: int, metrics: Any) -> None:
        self.write(step, {f"validation/{name}": value for name, value in metrics.values().items()})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._append(event(time.time(), step=step, scalars={k: float(v) for k, v in scalars.items()}))

    def _memory(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {
                "memory/allocated_mb": torch.cuda.memory_allocated(self.device) / 2**20,
                "memory/reserved_mb": torch.cuda.memory_reserved(self.device) / 2**20,
                "memory/peak_mb": peak_memory_mb(self.device),
            }
        return {"memory/rss_mb": _rss_mb(), "memory/peak_mb": peak_memory_mb(self.device)}

    def _append(self, data: bytes) -> None:
        if self.path is None:
            return
        try:
            # Open-append-close per point: a few writes per minute, and nothing to close if
            # the trial dies.
            with self.path.open("ab") as f:
                f.write(tfrecord(data))
        except OSError as exc:
            self._disable(exc)

    def _disable(self, exc: OSError) -> None:
        log.warning("training curves disabled for this trial: %s", exc)
        self.path = None


def _rss_mb() -> float:
    """Current resident memory (not the peak) of this process, from /proc where it exists."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
