"""Live progress on a terminal, plain lines when piped, per-trial logs and TensorBoard curves."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from hpsearch.search.views.progress import Snapshot
from tests.conftest import hpsearch


def run_in_pty(args: list[str], cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """Run the real CLI with a pseudo-terminal as its stdin, stdout and stderr."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color"}
    env.pop("HPSEARCH_STORAGE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.search.cli.main", *args],
        cwd=cwd,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every holder of the terminal's other end has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return code, b"".join(chunks).decode(errors="replace")


def test_live_display_on_a_terminal(tmp_path: Path, spec_file: Path) -> None:
    code, out = run_in_pty(
        [
            "start",
            "--study",
            "live",
            "--config",
            str(spec_file),
            "--storage",
            f"sqlite:///{tmp_path / 's.db'}",
            "--devices",
            "cpu:1",
            "--n-trials",
            "1",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        cwd=tmp_path,
    )
    assert code == 0, out[-3000:]
    # A live display: the cursor is hidden, the status lines are redrawn in place
    # (cursor up + erase), and the cursor comes back at the end.
    assert "\x1b[?25l" in out and "\x1b[?25h" in out
    redraws = out.count("\x1b[J")
    assert redraws >= 3, out[-2000:]
    final = out.rsplit("\x1b[J", 1)[1]
    assert "hpsearch live [########################] 1/1 trials finished" in final, final
    assert "0 failed" in final and "best loss" in final and "done" in final
    # The worker's own log lines scroll above the display as whole lines, never torn by it.
    worker_lines = [line for line in out.replace("\r", "").split("\n") if "trial 0 starts" in line]
    assert worker_lines, out[-3000:]
    assert all("hpsearch live [" not in line for line in worker_lines)
    # The summary printed after the search still reaches the terminal.
    assert "best: trial 0" in final


def test_plain_lines_when_piped_with_trial_logs_and_curves(tmp_path: Path, spec_file: Path) -> None:
    runs = tmp_path / "runs"
    result = hpsearch(
        "start",
        "--study",
        "piped",
        "--config",
        str(spec_file),
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        "--devices",
        "cpu:1",
        "--output-dir",
        str(runs),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b[" not in result.stderr and "\x1b[" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if " progress: " in line]
    assert any("2/2 trials finished" in line and line.endswith("done") for line in lines), lines
    assert any("0/2 trials finished" in line or "1/2 trials finished" in line for line in lines), lines

    for number in (0, 1):
        trial_dir = runs / "piped" / f"trial-{number}"
        # Per-trial log file.
        log_text = (trial_dir / "train.log").read_text()
        assert f"trial {number} starts" in log_text and "train_loss" in log_text
        # TensorBoard curves: at least the completed trial has all 4 validation points
        # (320 examples / batch 32 = 10 steps per epoch, 2 epochs, eval every 5).
        files = list((trial_dir / "tensorboard").glob("events.out.tfevents.*"))
        assert len(files) == 1
        scalars = read_scalars(files[0])
        steps = [step for step, _ in scalars["train/loss"]]
        assert steps[0] == 5 and steps == sorted(steps) and set(steps) <= {5, 10, 15, 20}
        for tag in (
            "train/learning_rate",
            "train/samples_per_second",
            "memory/rss_mb",
            "memory/peak_mb",
            "validation/loss",
            "validation/accuracy",
        ):
            assert [s for s, _ in scalars[tag]] == steps, tag
        assert all(v > 0 for _, v in scalars["train/samples_per_second"])
        assert all(0 < v < 2 for _, v in scalars["train/loss"])
        # Linear decay of the learning rate: it only goes down.
        lrs = [v for _, v in scalars["train/learning_rate"]]
        assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0


def test_training_runs_without_tensorboard_installed(tmp_path: Path) -> None:
    # Block any import of tensorboard, then write a curve as the loop does.
    code = f"""
import sys
sys.modules["tensorboard"] = None
import torch
from pathlib import Path
import hpsearch.trainer.loop
from hpsearch.trainer.curves import Curves
from hpsearch.trainer.stats import Throughput
speed = Throughput(torch.device("cpu"))
speed.add(examples=32, tokens=500); speed.seconds = 2.0
c = Curves(Path({str(tmp_path)!r}, "tensorboard"), torch.device("cpu"))
c.train(7, loss=0.5, lr=1e-4, speed=speed)
print(sorted(p.name[:20] for p in Path({str(tmp_path)!r}, "tensorboard").iterdir()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "events.out.tfevents." in out.stdout
    scalars = read_scalars(next((tmp_path / "tensorboard").iterdir()))
    assert scalars["train/loss"] == [(7, 0.5)]
    assert scalars["train/samples_per_second"] == [(7, 16.0)]


def test_unwritable_curve_folder_does_not_stop_training(tmp_path: Path) -> None:
    import torch

    from hpsearch.trainer.curves import Curves
    from hpsearch.trainer.stats import Throughput

    (tmp_path / "tensorboard").write_text("a file where the folder should be")
    curves = Curves(tmp_path / "tensorboard", torch.device("cpu"))
    curves.train(1, loss=1.0, lr=1e-3, speed=Throughput(torch.device("cpu")))
    assert curves.path is None


def test_time_left_spreads_remaining_work_over_running_trials() -> None:
    s = Snapshot(
        n_trials=10,
        metric="loss",
        complete=3,
        pruned=1,
        failed=1,
        running=2,
        mean_trial_s=100.0,
        running_elapsed=[30.0, 150.0],
    )
    # 10 - 4 finished - 1 failed - 2 running = 3 not started: 300 s, plus 70 s + 0 s left on
    # the running ones, over 2 parallel trials.
    assert s.time_left_s() == pytest.approx(185.0)
    assert Snapshot(n_trials=5, metric="loss").time_left_s() is None


# -- the event files, read by TensorBoard itself -------------------------------------------


def read_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of one event file, as TensorBoard reads it (step, value to 5 places)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
