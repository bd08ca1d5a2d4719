"""Headless Chromium for the dashboard test and screenshot (no Python browser driver needed).

Uses Chromium's own command line: ``--dump-dom`` prints the DOM after the
page's scripts ran, ``--screenshot`` writes a PNG; ``--virtual-time-budget``
lets timers and fetches run before either happens (Chromium's headless
documentation, "Command-line flags").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> Optional[str]:
    """Path of a Chromium/Chrome binary (``$MLXGW_CHROMIUM`` first), or None."""
    env = os.environ.get("MLXGW_CHROMIUM")
    if env and Path(env).exists():
        return env
    mac = Path("/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")
    for n in _NAMES:
        p = shutil.which(n)
        if p:
            return p
    return str(mac) if mac.exists() else None


def _run(extra: list[str], url: str, budget_ms: int, size: tuple[int, int], timeout: float) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium binary (install Debian's 'chromium' or set MLXGW_CHROMIUM)")
    with tempfile.TemporaryDirectory(prefix="mlxgw-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--virtual-time-budget={budget_ms}", *extra, url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"chromium exited {out.returncode}: {out.stderr[-2000:]}")
    return out


def dump_dom(url: str, budget_ms: int = 3000, size: tuple[int, int] = (1280, 900), timeout: float = 90) -> str:
    """The serialized DOM of ``url`` after ``budget_ms`` of virtual time.

    Raises:
        FileNotFoundError: no Chromium; RuntimeError: Chromium failed.
    """
    return _run(["--dump-dom"], url, budget_ms, size, timeout).stdout


def screenshot(url: str, path: Path, budget_ms: int = 3000, size: tuple[int, int] = (1280, 900),
               timeout: float = 90) -> Path:
    """Write a PNG of ``url`` to ``path`` after ``budget_ms`` of virtual time; returns ``path``.

    Raises:
        FileNotFoundError: no Chromium; RuntimeError: Chromium failed or wrote nothing.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--screenshot={path}"], url, budget_ms, size, timeout)
    if not path.exists() or path.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {path}")
    return path
