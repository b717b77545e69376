"""A wheel installed in a fresh virtual environment finds its configs from any directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_in_fresh_venv_runs_from_another_directory(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = dist.glob("speedbench-*.whl")
    venv = tmp_path / "venv"
    # The venv sees this interpreter's torch & co. (no 5 GB reinstall) but gets its own speedbench.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import speedbench, speedbench.config as c; "
                            "print(speedbench.__file__); print(c.config_dir())"],
                           cwd=elsewhere, capture_output=True, text=True, check=True).stdout.split()
    assert str(venv) in where[0] and str(venv) in where[1], where
    show = subprocess.run([str(py), "-m", "speedbench", "+experiment=amp", "--cfg", "job"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "fp16" in show.stdout and "resnet" in show.stdout
