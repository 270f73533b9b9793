"""Delivers a run's reporter calls on a background thread, in order, so training need not wait.

A report takes milliseconds, but minutes of retries while the database restarts, and a waiting GPU
trains nothing. Delivery stops at the first failed call: later reports would be out of step with the retried run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Parcel:
    """One call, ``fn(*args)``; ``done`` is set once it has returned or raised (or was dropped)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.sent = time.monotonic()
        self.result: Any = None
        self.done = threading.Event()


class ReportQueue:
    """A run's reporter calls, made in order on a background thread (or at once, ``inline``)."""

    # The thread ends after this long idle (the next call starts another): a run that ends on an
    # exception leaves no thread behind for long.
    IDLE_S = 5.0

    def __init__(self, *, inline: bool = False) -> None:
        # inline: each call at once, on the caller's thread: for a reporter that never waits (in
        # memory) or that must see the model as it is at the call (a benchmark scoring it).
        self.inline = inline
        self._queue: queue.SimpleQueue[Parcel] = queue.SimpleQueue()
        self._pending: deque[Parcel] = deque()  # sent, not yet done: oldest first
        self._lock = threading.Lock()  # over _pending and _thread
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the first call that failed; nothing is sent after it

    def send(self, fn: Callable[..., Any], *args: Any) -> Parcel:
        parcel = Parcel(fn, args)
        if self.inline:
            self._make(parcel)
            parcel.done.set()
            return parcel
        with self._lock:
            self._pending.append(parcel)
            self._queue.put(parcel)
            if self._thread is None:
                self._thread = threading.Thread(target=self._deliver, name="hpsearch-report", daemon=True)
                self._thread.start()
        return parcel

    def oldest(self) -> Parcel | None:
        """The call the search has kept waiting longest, if any is still on its way."""
        with self._lock:
            return self._pending[0] if self._pending else None

    def newest(self) -> Parcel | None:
        """The last call sent, if it is still on its way: once it is done, every call is."""
        with self._lock:
            return self._pending[-1] if self._pending else None

    def _deliver(self) -> None:
        while True:
            try:
                parcel = self._queue.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # send() puts under the lock: nothing can slip in now
                        self._thread = None
                        return
                continue
            self._make(parcel)
            with self._lock:
                self._pending.popleft()
            parcel.done.set()

    def _make(self, parcel: Parcel) -> None:
        if self.error is not None:
            return
        try:
            parcel.result = parcel.fn(*parcel.args)
        except BaseException as exc:
            self.error = exc
