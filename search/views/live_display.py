"""The live display of `hpsearch start` on a terminal: status lines kept at the bottom, with every
log line, the workers' included, scrolling above them (progress.py has the numbers)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from hpsearch.search.study.spec import StudySpec
from hpsearch.search.views.progress import Progress

BAR_WIDTH = 24


class LiveProgress(Progress):
    """Status lines redrawn at the bottom of the terminal; all output scrolls above them. The workers' stdout/stderr
    would tear them, so they point at a pipe while a child starts, and a thread prints what comes through above the
    status lines, as the parent's own log records (docs/decisions.md, "The live display keeps its own drawing")."""

    def __init__(self, study_name: str, storage_url: str, spec: StudySpec, stream: TextIO) -> None:
        super().__init__(study_name, storage_url, spec)
        self.fd = stream.fileno()
        self._pending: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._drawn = 0
        self._block: list[str] = []
        self._read_fd, self._write_fd = os.pipe()
        self._reader = threading.Thread(target=self._read_children, name="hpsearch-output", daemon=True)
        self._handlers: list[tuple[logging.StreamHandler[Any], Any]] = []

    def start(self) -> None:
        self._reader.start()
        # Route the parent's console log records through the display (restored on exit).
        line_stream = _LineStream(self)
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
                self._handlers.append((handler, handler.setStream(line_stream)))
        self._write(b"\x1b[?25l")  # hide the cursor while redrawing
        super().start()

    def finish(self) -> None:
        os.close(self._write_fd)  # the reader sees EOF once every child has exited
        self._reader.join(timeout=2)
        self.render()
        self._write(b"\x1b[?25h")
        for handler, stream in self._handlers:
            handler.setStream(stream)

    @contextlib.contextmanager
    def capture_output(self) -> Iterator[None]:
        targets = [fd for fd in (1, 2) if os.isatty(fd)]
        saved = [(fd, os.dup(fd)) for fd in targets]
        try:
            for fd in targets:
                os.dup2(self._write_fd, fd)
            yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)

    def render(self) -> None:
        snap = self.poller.latest
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        if snap is None:
            block = [f"hpsearch {self.study_name}: reading the study..."]
        else:
            done = min(BAR_WIDTH, round(BAR_WIDTH * snap.finished / max(1, snap.n_trials)))
            bar = "#" * done + "-" * (BAR_WIDTH - done)
            block = [f"hpsearch {self.study_name} [{bar}] {self.line(snap)}"]
        if devices := self.devices_line():
            block.append(devices)
        self._block = [_fit(line, width) for line in _wrap(block, width)]
        self.flush()

    def add_line(self, text: str) -> None:
        self._pending.append(text)
        self.flush()

    def flush(self) -> None:
        # Never wait for the lock: a signal handler logging mid-draw would deadlock. Its holder drains the queue.
        if not self._lock.acquire(blocking=False):
            return
        try:
            out = []
            if self._drawn:
                out.append(f"\r\x1b[{self._drawn}A\x1b[J")
            while self._pending:
                out.append(self._pending.popleft() + "\n")
            out += [line + "\n" for line in self._block]
            self._drawn = len(self._block)
            self._write("".join(out).encode(errors="replace"))
        finally:
            self._lock.release()

    def _read_children(self) -> None:
        partial = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(self._read_fd, 65536):
                partial += chunk
                *lines, partial = partial.split(b"\n")
                for line in lines:
                    # A carriage return means "overwrite this line" (progress bars): keep the last.
                    self.add_line(line.decode(errors="replace").rstrip("\r").rsplit("\r", 1)[-1])
        if partial:
            self.add_line(partial.decode(errors="replace"))
        os.close(self._read_fd)

    def _write(self, data: bytes) -> None:
        # The terminal may go away (closed ssh session): keep searching regardless.
        with contextlib.suppress(OSError):
            os.write(self.fd, data)


@dataclass
class _LineStream:
    """A file-like target for logging handlers that prints whole lines above the display."""

    live: LiveProgress

    def write(self, text: str) -> int:
        for line in text.rstrip("\n").split("\n"):
            self.live.add_line(line)
        return len(text)

    def flush(self) -> None:
        pass


def _wrap(lines: list[str], width: int) -> list[str]:
    """Split the long status line at its commas so it fits narrow terminals."""
    out = []
    for line in lines:
        while len(line) > width and ", " in line[:width]:
            cut = line[:width].rindex(", ")
            out.append(line[: cut + 1])
            line = "  " + line[cut + 2 :]
        out.append(line)
    return out


def _fit(line: str, width: int) -> str:
    # A wrapped line would break the count of lines to redraw.
    return line if len(line) <= width else line[: width - 1] + "~"
