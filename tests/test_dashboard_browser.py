"""A real browser (Debian's headless Chromium) opens the study in `hpsearch dashboard`.

The page is a single-page app that fetches the study over the dashboard's API, so only a
browser that runs its JavaScript sees the trials. The screenshot is kept under
test-artifacts/ (CI keeps that folder; git ignores it).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import optuna
import pytest

from tests.test_dashboard import STUDY, dashboard, finished_study

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,1000",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("chromium is not installed (CI must install Debian's chromium package)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def browse(binary: str, url: str, *extra: str, budget_ms: int = 20000) -> subprocess.CompletedProcess[str]:
    """Load ``url`` and let the page run ``budget_ms`` of virtual time (its API calls included)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [
                binary,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget_ms}",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"], ids=["loopback", "token"])
def test_browser_shows_trials_and_best_checkpoint(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    demo_files: tuple[Path, Path],
    host: str,
) -> None:
    binary = chromium()
    storage = finished_study(tmp_path_factory, tiny_model, demo_files)
    best = optuna.load_study(study_name=STUDY, storage=storage).best_trial
    checkpoint = best.user_attrs["best_checkpoint"]
    with dashboard("--study", STUDY, "--storage", storage, "--host", host, cwd=tmp_path) as printed:
        # Off 127.0.0.1 the printed URL carries the token: the page is served with a cookie that
        # the page's own API calls (the trials, the curves) must then carry, or nothing renders.
        url, _, token = printed.partition("?token=")
        assert bool(token) == (host != "127.0.0.1"), printed
        query = f"&token={token}" if token else ""
        # The study's trial list, with its best trial selected: trials, curves, user attributes.
        page = f"{url}/trials?numbers={best.number}{query}"
        text = ""
        for _ in range(3):  # a loaded CI machine may need more than one budget to render
            rendered = browse(binary, page, "--dump-dom")
            text = visible_text(rendered.stdout)
            if "best_checkpoint" in text:
                break
        ARTIFACTS.mkdir(exist_ok=True)
        suffix = "" if host == "127.0.0.1" else "-token"
        shot = ARTIFACTS / f"dashboard-trials{suffix}.png"
        shot.unlink(missing_ok=True)
        browse(binary, page, f"--screenshot={shot}")
        overview = ARTIFACTS / f"dashboard-study{suffix}.png"
        overview.unlink(missing_ok=True)
        browse(binary, printed, f"--screenshot={overview}")
    assert "Trial 0" in text and "Trial 1" in text, text[:2000]
    assert f"Trial {best.number} (trial_id=" in text
    assert "best_checkpoint" in text and checkpoint in text, text[:3000]
    for attr in ("train_samples_per_second", "peak_memory_mb", "device", "host"):
        assert attr in text
    # A PNG was written, and it is a real page, not an empty canvas.
    for png in (shot, overview):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (png, len(data))
