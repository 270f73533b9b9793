"""The test's end of HPSEARCH_FAULT_HOLD (tests/support/faults/sitecustomize.py): a rank stops before a given step
and waits here until the test releases it or kills it. A test that must act on a RUNNING trial at a known step
waits for this event instead of polling the study for a window the trial may already have closed."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.inject import faults_env


class Hold:
    """Listens for the held rank; ``env`` goes to the process the test starts (with any other fault's variables)."""

    def __init__(self, *steps: int, rank: int = 0) -> None:
        # A short path of its own: a Unix socket's path is limited to 108 bytes, a pytest tmp_path can be longer.
        self._dir = Path(tempfile.mkdtemp(prefix="hold-"))
        self.path = self._dir / "s"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.path))
        self._server.listen(1)
        self._left = len(steps)  # holds still to come; the socket closes after the last
        self._conn: socket.socket | None = None
        self.pid = 0
        self.step = 0
        self.env = {"HPSEARCH_FAULT_HOLD": f"{rank}:{','.join(map(str, steps))}:{self.path}"}

    def with_faults(self, **faults: str) -> dict[str, str]:
        """The environment that injects this hold and ``faults`` (their module on the processes' PYTHONPATH)."""
        return faults_env(**self.env, **faults)

    def wait(self, proc: subprocess.Popen[str], timeout: float = 600) -> int:
        """Until the rank is held at its next step (its pid is returned), failing at once if ``proc`` ends first. A
        rank still held at an earlier step is released first."""
        self.release()
        deadline = time.monotonic() + timeout
        self._server.settimeout(1)  # wakes on the connection at once; the timeout only looks at ``proc``
        while self._conn is None:
            try:
                self._conn, _ = self._server.accept()
            except TimeoutError:
                if proc.poll() is not None:
                    _, err = proc.communicate()
                    raise AssertionError(f"start exited ({proc.returncode}) before a hold: {err[-3000:]}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"no rank reached the hold in {timeout:.0f} s") from None
        self._left -= 1
        if not self._left:
            # A later trial or retry that reaches the step finds no one listening and trains on.
            self._server.close()
        self._conn.settimeout(timeout)
        line = b""
        while not line.endswith(b"\n"):
            line += self._conn.recv(64) or b"\n"
        pid, step = line.split()
        self.pid, self.step = int(pid), int(step)
        return self.pid

    def release(self) -> None:
        """Lets the held rank train on (also what ``close`` does)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.release()
        self._server.close()
        self.path.unlink(missing_ok=True)
        for dump in self._dir.glob("*.stacks"):  # the held processes' stack files (faults/sitecustomize.py)
            dump.unlink()
        self._dir.rmdir()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
