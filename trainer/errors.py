"""Errors of the trainer that the CLI reports as bad input (kept free of heavy imports), and the one test of a full
disk, however a library wraps it."""

from __future__ import annotations

import errno

DISK_FULL_WORDS = (
    "No space left on device",
    "Disk quota exceeded",
    "os error 28",  # Rust's io::Error as tokenizers prints it; os error 122 is EDQUOT
    "os error 122",
    "kind: StorageFull",  # ... and as safetensors debug-prints it
    "kind: QuotaExceeded",
)
"""How a full disk reads where it is not an OSError: safetensors' and tokenizers' Rust errors carry the OS's words."""


class ModelError(ValueError):
    """The model or its tokenizer cannot be loaded; the message says why and what to do."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, is a full disk (or quota): an OSError's ENOSPC/EDQUOT, or
    the OS's words inside another library's error (SafetensorError, a tokenizer's, torch's RuntimeError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(exc) for words in DISK_FULL_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class RankOutOfMemory(Exception):
    """A rank of a multi-device trial ran out of memory at micro-batch ``micro``. Its peers already wait in a
    collective it will never enter, so the group cannot halve in place as one device does: the micro-batch is
    recorded in the trial's folder and the group restarts, every rank starting smaller (docs/decisions.md)."""

    def __init__(self, micro: int, step: int, rank: int) -> None:
        super().__init__(f"rank {rank} ran out of memory at step {step}, micro-batch {micro}")
        self.micro, self.step, self.rank = micro, step, rank
