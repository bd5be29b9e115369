"""A regular (non-editable) install carries the demo: the wheel holds the demo model, its
calibration and held-out text and every recipe file, at the paths the code reads them from."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qserve.quantize import demo, recipes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_PARENT = ROOT  # qserve/ sits at the repository root


def _in_package(path: Path) -> str:
    """``path`` as the wheel names it (relative to the directory holding ``qserve/``)."""
    return path.resolve().relative_to(PACKAGE_PARENT).as_posix()


def test_demo_and_recipes_live_inside_the_package():
    package = (ROOT / "qserve").resolve()
    for path in (demo.DEMO_MODEL, demo.DEMO_CALIB, demo.DEMO_HELDOUT, recipes.RECIPES_DIR):
        assert package in path.resolve().parents, f"{path} is outside the qserve package"


def test_wheel_carries_the_demo_and_the_recipes(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("qserve", "quant_kernels", "loaders"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("qserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [demo.DEMO_CALIB, demo.DEMO_HELDOUT, *sorted(demo.DEMO_MODEL.iterdir())]
    needed += sorted(recipes.RECIPES_DIR.glob("*/*.json"))
    assert len(needed) > 20
    missing = [_in_package(p) for p in needed if _in_package(p) not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert "qserve/server/ui/app.js" in names
