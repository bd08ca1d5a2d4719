"""Which code a benchmark ran: written beside each results file's command (helper-72: the
commits in the docs were added by hand, and a run of uncommitted code looked like any other)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=4)
def revision(root: Path = ROOT) -> str:
    """The short commit of the checkout at ``root`` (this one by default), with ``+ uncommitted changes`` when tracked files differ
    from it (untracked files, such as results, do not count); ``unknown`` outside a git
    checkout or without git. Never raises."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")
