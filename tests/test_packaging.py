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


def test_setup_script_import_check_passes_under_a_low_hard_open_files_limit():
    """scripts/setup.sh (both README commands) checks the install by importing mlx-lm. A bare
    ``import mlx_lm`` dies under a hard open-files limit below 4096 (mlx-lm issue 1589: it
    calls ``setrlimit(NOFILE, (2048, 4096))``), so the script said "install failed" in a
    shell with ``ulimit -n 2048`` where mlxgw itself runs; its check goes through mlxgw's guard."""
    import re
    import resource
    import subprocess
    import sys
    from pathlib import Path

    script = (Path(__file__).resolve().parent.parent / "scripts" / "setup.sh").read_text()
    check = re.search(r'^IMPORT_CHECK="([^"]+)"$', script, re.M).group(1)
    assert "import mlx_lm" in check

    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))

    bare = subprocess.run([sys.executable, "-c", "import mlx_lm"], preexec_fn=low, capture_output=True, text=True)
    guarded = subprocess.run([sys.executable, "-c", check + "; import resource; "
                              "print(resource.getrlimit(resource.RLIMIT_NOFILE))"],
                             preexec_fn=low, capture_output=True, text=True)
    # mlx-lm 0.32.2 fails here; a later 0.32.x may not (the issue has a fix PR), and the guard
    # must still pass either way.
    assert bare.returncode == 0 or "not allowed to raise maximum limit" in bare.stderr
    assert guarded.returncode == 0 and guarded.stdout.strip() == "(2048, 2048)", guarded.stderr


def test_setup_script_skips_pip_once_this_pyproject_and_extras_are_installed(tmp_path):
    """helper-92: every `scripts/serve.sh` start ran pip (upgrade and editable install, ~6 s,
    asking PyPI each time). After a finished install of the same pyproject.toml and extras it
    runs none; another extras set, or a changed pyproject.toml, installs again."""
    import os
    import stat

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "pip.log"
    # This venv's Python, except that pip only writes down what it was asked
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)

    def setup(*extras: str) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *extras], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHON": sys.executable})
        assert r.returncode == 0, r.stderr
        return (log.read_text().splitlines() if log.exists() else [])[len(before):]

    assert setup() == ["-m pip install -q --upgrade pip", "-m pip install -q -e ."]
    assert setup() == []
    assert setup("test") == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[test]"]
    assert setup("test") == [] and setup() == []
    with open(tmp_path / "pyproject.toml", "a") as f:
        f.write("\n# a changed dependency list\n")
    assert setup() == ["-m pip install -q --upgrade pip", "-m pip install -q -e ."]
    assert setup() == []
