"""Headless Chromium for checking and screenshotting reports (tests, docs); reports never need it to be written.

Chromium is run with a fresh profile directory, no network features, and a hard timeout: SIGTERM first, then
kill, so a wedged browser never outlives its caller.  ``scripts/ensure_chromium.sh`` installs it on Debian.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(binary: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="planner-chromium-") as profile_dir:
        cmd = [binary, *FLAGS, f"--user-data-dir={profile_dir}", *args]
        # Own process group: on timeout the renderer/gpu children go too.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            raise TimeoutError(f"chromium did not finish within {timeout_s:.0f} s: {' '.join(cmd)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def screenshot(html_path: str | os.PathLike[str], png_path: str | os.PathLike[str], *, width_px: int = 1280,
               height_px: int = 2000, timeout_s: float = 90.0, binary: str | None = None) -> None:
    """Render a local HTML file and save a PNG of the first `height_px` pixels of the page."""
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("chromium not found; run scripts/ensure_chromium.sh")
    url = Path(html_path).resolve().as_uri()
    res = _run(binary, [f"--screenshot={Path(png_path).resolve()}", f"--window-size={width_px},{height_px}", url],
               timeout_s)
    if res.returncode != 0 or not Path(png_path).exists():
        raise RuntimeError(f"chromium screenshot failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")


def dump_dom(html_path: str | os.PathLike[str], *, timeout_s: float = 90.0, binary: str | None = None) -> str:
    """The page's DOM after load, as serialized by Chromium."""
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("chromium not found; run scripts/ensure_chromium.sh")
    res = _run(binary, ["--dump-dom", Path(html_path).resolve().as_uri()], timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    return res.stdout
