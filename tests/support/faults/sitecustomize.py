"""Fault injection for tests that run hpsearch in other processes (a CLI, its workers, their ranks), where pytest's
monkeypatch cannot reach. A test puts this folder on PYTHONPATH (``faults.env``) with the fault it wants; Python
imports this module as each process starts, and only then is the product touched: it carries no test hook itself.

HPSEARCH_FAULT_OOM="RANK:STEP:MICRO": rank RANK runs out of memory in the forward/backward of every optimizer step
from STEP on whenever its micro-batch is larger than MICRO, as a device too small for it would (a CPU never does).

HPSEARCH_FAULT_HOLD="RANK:STEP:SOCKET": rank RANK, about to take its optimizer step after STEP steps (its validation
point at STEP done), connects to the Unix socket SOCKET, sends its pid and waits until the test answers: the trial
is held RUNNING at a known step for as long as the test needs to kill it, stop it or cut its database, where a poll
of the study could see it finish first. STEP may be several steps ("10,15"): one hold at each. A stop signal the
process handles (SIGTERM, SIGINT, the supervisor's SIGUSR1/SIGUSR2) runs the product's handler and lets the rank go,
so that it stops at its next step as it would unheld. No one listening (the test let go): the rank goes on at once.
Each process holds once at each step (tests/support/hold.py is the other end).
"""

from __future__ import annotations

import os
from typing import Any

if fault := os.environ.get("HPSEARCH_FAULT_OOM"):
    import torch

    from hpsearch.trainer import step as _step

    _at_rank, _from_step, _fits = (int(v) for v in fault.split(":"))
    _current = {"step": 0}
    _train_step, _accumulate = _step.train_step, _step._accumulate

    def train_step(model: Any, parts: Any, batches: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        _current["step"] = step
        return _train_step(model, parts, batches, step, *args, **kwargs)

    def accumulate(model: Any, data: Any, mine: list[list[int]], *args: Any) -> Any:
        world = args[-1]
        micro = max((len(ids) for ids in mine), default=0)
        if world.rank == _at_rank and _current["step"] >= _from_step and micro > _fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by HPSEARCH_FAULT_OOM={fault})")
        return _accumulate(model, data, mine, *args)

    _step.train_step, _step._accumulate = train_step, accumulate
    from hpsearch.trainer import loop as _loop

    _loop.train_step = train_step  # loop.py imported it by name

if fault := os.environ.get("HPSEARCH_FAULT_HOLD"):
    import faulthandler
    import select
    import signal

    # A test whose held start hangs sends SIGQUIT before killing it: every thread's stack goes to a file per process.
    _dumps = open(f"{fault.rsplit(':', 1)[1]}.{os.getpid()}.stacks", "w")  # noqa: SIM115 (open while the process lives)
    faulthandler.register(signal.SIGQUIT, file=_dumps, all_threads=True)
    import socket
    import threading

    import torch.distributed

    from hpsearch.trainer import loop as _hold_loop

    _rank, _steps, _socket = fault.split(":", 2)
    _hold_rank, _hold_steps = int(_rank), sorted(int(s) for s in _steps.split(","))
    _held_step = _hold_loop.train_step  # the OOM fault's wrapper, when both are set
    _STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

    class _Released(Exception):
        """A stop signal came while the rank was held."""

    def _hold(step: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            try:
                conn.connect(_socket)
            except OSError:
                return  # the test has let go of its hold: train on
            # A stop signal lets the rank go once, and only while it waits: a second one (a process-group SIGTERM
            # and the supervisor's forwarded SIGUSR2 come together) must not raise into training.
            waiting = {"now": True}
            handlers = {}
            if threading.current_thread() is threading.main_thread():
                for signum in _STOPS:
                    handlers[signum] = previous = signal.getsignal(signum)
                    if callable(previous):

                        def stop(signum: int, frame: Any, previous: Any = previous) -> None:
                            # Claimed before the product's handler runs: a signal that lands inside it (inside its
                            # logging call) only runs the product's handler, and this one lets the rank go.
                            first, waiting["now"] = waiting["now"], False
                            previous(signum, frame)
                            if first:
                                raise _Released

                        signal.signal(signum, stop)
            try:
                try:
                    # Said only now that the handlers are in place: the test signals as soon as it hears.
                    conn.sendall(f"{os.getpid()} {step}\n".encode())
                    _wait_for_release(conn, with_signals=bool(handlers))
                finally:
                    waiting["now"] = False
            except (_Released, OSError):
                pass
            for signum, previous in handlers.items():
                signal.signal(signum, previous)

    def _wait_for_release(conn: socket.socket, *, with_signals: bool) -> None:
        """Until the test releases the rank (a byte or a close) or kills it; a stop signal runs its handler here.
        Not by waiting in recv alone: the kernel hands a process's signal to any of its threads (the heartbeat's,
        the TensorBoard writer's), and only one landing on this, the main thread, interrupts its recv, so a stop
        that landed elsewhere was never handled and the rank waited for the 60 s timeout (CI, under load). Python
        writes every signal it catches, on any thread, to the wakeup fd: waiting on it too wakes this thread, whose
        next line runs the handlers."""
        if not with_signals:
            conn.recv(1)
            return
        wake, wakeup = socket.socketpair()
        wakeup.setblocking(False)
        previous = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
        try:
            while not select.select([conn, wake], [], [])[0].count(conn):
                wake.recv(64)  # a signal came: its Python handler runs between this line and the next
            conn.recv(1)
        finally:
            signal.set_wakeup_fd(previous)
            wake.close()
            wakeup.close()

    def held_train_step(model: Any, parts: Any, batches: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        while _hold_steps and step >= _hold_steps[0] and rank == _hold_rank:
            _hold(_hold_steps.pop(0))
        return _held_step(model, parts, batches, step, *args, **kwargs)

    _hold_loop.train_step = held_train_step
