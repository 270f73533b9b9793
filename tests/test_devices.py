"""--devices and the GPU each worker process is given, on a machine shared through CUDA_VISIBLE_DEVICES.

No GPU is needed: what a worker's torch will see is decided by the CUDA_VISIBLE_DEVICES its
process starts with, and that is what these tests read, from real spawned processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from hpsearch.search.workers import devices
from hpsearch.search.workers.devices import Device, DeviceError
from tests.conftest import spec_text


def _report_visible(queue: mp.Queue) -> None:  # type: ignore[type-arg]
    queue.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_in_child(cuda_id: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES as a process spawned under ``only_gpu(cuda_id)`` sees it."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_report_visible, args=(queue,))
    with devices.only_gpu(cuda_id):
        process.start()
    seen = queue.get(timeout=60)
    process.join(60)
    return seen


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: [0, 1, 2, 3])


def test_a_worker_gets_the_host_gpu_behind_the_index_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    # A shared 8-GPU machine where this user was given GPUs 4..7: hpsearch numbers them 0..3,
    # and the worker for GPU 2 must land on the host's GPU 6, not on somebody's GPU 2.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    (cuda_id,) = Device("cuda", 2).child_ids()
    assert cuda_id == "6"
    assert visible_in_child(cuda_id) == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # ours is back as it was


def test_a_device_group_maps_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa, GPU-bbbb,GPU-cccc,GPU-dddd")
    groups = devices.group([Device("cuda", i) for i in range(4)], 2, "0,1,2,3")
    assert [g.child_ids() for g in groups] == [("GPU-aaaa", "GPU-bbbb"), ("GPU-cccc", "GPU-dddd")]


def test_without_cuda_visible_devices_the_index_is_the_host_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert Device("cuda", 1, (3,)).child_ids() == ("1", "3")
    assert visible_in_child("1") == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_cpu_workers_keep_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert Device("cpu", 0, (1, 2)).child_ids() == ("0", "1", "2")
    assert visible_in_child(None) == "3"


def test_gpus_may_be_given_as_pytorch_names(four_gpus: None) -> None:
    assert devices.parse("cuda:1,cuda:3") == [Device("cuda", 1), Device("cuda", 3)]
    assert devices.parse("0, 2") == [Device("cuda", 0), Device("cuda", 2)]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("cuda:4", "no GPU 4 on this host (GPUs: 0, 1, 2, 3)"),
        ("1,cuda:1", "a GPU is listed twice"),
        ("gpu0", "use GPU indices like 0,1"),
        ("cpu:0", "the CPU worker count must be an integer"),
    ],
)
def test_bad_devices_are_named(four_gpus: None, flag: str, message: str) -> None:
    with pytest.raises(DeviceError, match=re.escape(message)):
        devices.parse(flag)


def test_a_gpu_host_whose_torch_cannot_use_its_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU build of torch in a GPU instance's venv: falling back to the CPU would bill GPU-hours
    # for CPU speed, so the default says what to fix. This torch is the CPU build.
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    monkeypatch.setattr(devices, "host_nvidia_gpus", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError) as refused:
        devices.parse(None)
    message = str(refused.value)
    assert "this host has 2 NVIDIA GPU(s) but torch" in message
    assert "CPU-only build" in message and "--devices cpu:1" in message
    # Asked for explicitly, or with every GPU hidden on purpose, the CPU is fine.
    assert devices.parse("cpu:1") == [Device("cpu", 0)]
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert devices.parse(None) == [Device("cpu", 0)]


def test_a_host_without_nvidia_gpus_trains_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    monkeypatch.setattr(devices, "host_nvidia_gpus", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.parse(None) == [Device("cpu", 0)]


@pytest.mark.parametrize(
    "cpus,workers,busy,expected",
    [(8, 1, 0.0, 8), (8, 2, 0.2, 4), (8, 3, 0.0, 2), (1, 2, 0.0, 1), (2, 4, 0.0, 1), (2, 1, 1.1, 1), (8, 2, 4.0, 2)],
    ids=lambda v: str(v),
)
def test_cpu_workers_split_the_cpus_they_may_run_on_that_other_work_leaves_free(
    monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int, busy: float, expected: int
) -> None:
    """The affinity mask, not the machine's CPU count (under taskset or a cpuset the two differ), less the CPUs
    another busy job holds: the issue's 2-core machine with one busy process trains on one thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    asked: list[frozenset[int]] = []

    def busy_now(ids: frozenset[int]) -> float:
        asked.append(ids)
        return busy

    assert devices.threads_per_worker([Device("cpu", i) for i in range(workers)], busy_now) == expected
    assert asked == [frozenset(range(cpus))]  # what is busy is asked of the CPUs we may run on, once


def test_a_machine_busy_for_the_last_minute_and_idle_now_gives_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 60: the 1-minute load average still counts a job that has just ended, and a worker started after it
    on an idle 2-core machine trained on one core. What is busy now decides; a job busy now keeps its core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 1.5, 0.8))  # the job that just ended
    one_worker = [Device("cpu", 0)]
    assert devices.threads_per_worker(one_worker, lambda ids: 0.02) == 2  # idle now (a daemon's tick)
    assert devices.threads_per_worker(one_worker, lambda ids: 0.97) == 1  # one core busy now: left alone
    assert devices.threads_per_worker(one_worker, lambda ids: 0.4) == 1  # a core shared 40% of the time too
    assert devices.threads_per_worker(one_worker, lambda ids: 1.9) == 1  # at least one thread, whatever runs


def test_the_cpu_times_of_the_real_proc_stat(tmp_path: Path) -> None:
    """/proc/stat as this kernel writes it: a line per CPU we may run on, busy within total, and the format's
    details (the "cpu" total line skipped, iowait free, steal busy, guest not counted twice, short old lines)."""
    stat = Path("/proc/stat")
    if not stat.exists():
        pytest.skip("no /proc/stat (not Linux)")
    times = devices.cpu_times(stat.read_text())
    assert os.sched_getaffinity(0) <= times.keys()
    assert all(0 <= busy <= total and total > 0 for busy, total in times.values())
    # user nice system idle iowait irq softirq steal guest guest_nice
    written = "cpu  9 9 9 9 9 9 9 9 9 9\ncpu0 10 1 4 100 20 2 3 5 7 0\ncpu12 1 0 1 8\nintr 5 0 0\n"
    assert devices.cpu_times(written) == {0: (25, 145), 12: (2, 10)}


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat (not Linux)")
def test_a_core_kept_busy_now_is_sampled_busy() -> None:
    """A real process spinning on one of our CPUs: the sample sees that CPU (nearly) all busy, whatever else the
    machine runs (other work on it only adds), and the sample takes about the time it says."""
    cpu = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {cpu})
    )
    try:
        time.sleep(0.3)  # past its start-up
        began = time.perf_counter()
        busy = devices.sample_busy(frozenset({cpu}))
        took = time.perf_counter() - began
    finally:
        spinner.kill()
        spinner.wait()
    assert busy > 0.8
    assert devices.SAMPLE_SECONDS <= took < devices.SAMPLE_SECONDS + 0.5


def test_a_user_set_omp_num_threads_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert devices.threads_per_worker([Device("cpu", 0), Device("cpu", 1)]) == 3
    assert devices.threads_per_worker([Device("cuda", 0)]) is None  # a GPU worker keeps torch's own


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to narrow the mask to one")
def test_a_trial_records_the_threads_its_worker_used(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """A worker started under a one-CPU mask on a bigger machine trains with one thread, and status shows it."""
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one = min(os.sched_getaffinity(0))
    result = subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli.main", "start", "--study", "t", "--config", str(spec)],
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1", "HPSEARCH_STORAGE": url},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, {one}),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (trial,) = optuna.load_study(study_name="t", storage=url).trials
    assert trial.user_attrs["torch_threads"] == 1
    header, row = next(
        (line.split(), result.stdout.splitlines()[i + 1].split())
        for i, line in enumerate(result.stdout.splitlines())
        if line.startswith("#  state")
    )
    assert row[header.index("threads")] == "1", result.stdout
