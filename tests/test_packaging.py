"""A built wheel holds every module of the tree (a non-editable install, e.g. the Docker
gateway image, once lacked ``gateway.dialects`` and could not start)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlxgw", "gateway", "backend")


def test_wheel_holds_every_module_and_the_dashboard(tmp_path):
    # Built from a copy: setuptools' build/ directory in a checkout would fill in what the
    # package list leaves out (as it did on the machine where this bug hid).
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in PACKAGES:
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("mlxgw-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {p.relative_to(src).as_posix() for d in PACKAGES for p in (src / d).rglob("*.py")}
    assert len(tree) > 40 and tree <= names, sorted(tree - names)
    assert "gateway/static/dashboard.html" in names
