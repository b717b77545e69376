"""A wheel installed in a fresh virtual environment finds its configs from any directory."""
from __future__ import annotations

import os
import site
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
    # --system-site-packages alone exposes the *base* interpreter's packages: when the tests run
    # inside a virtual environment, torch is in that environment's site-packages instead, so a
    # .pth file in the new venv adds the running interpreter's site directories after its own.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout's src/ first
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, env=env).stdout.strip()
    outer = site.getsitepackages() + [site.getusersitepackages()]
    (Path(purelib) / "outer_site_packages.pth").write_text(
        "".join(f"{d}\n" for d in outer if Path(d).is_dir()))
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert inst.returncode == 0, inst.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import speedbench, speedbench.config as c; "
                            "print(speedbench.__file__); print(c.config_dir())"],
                           cwd=elsewhere, capture_output=True, text=True, check=True,
                           env=env).stdout.split()
    assert str(venv) in where[0] and str(venv) in where[1], where
    show = subprocess.run([str(py), "-m", "speedbench", "+experiment=amp", "--cfg", "job"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "fp16" in show.stdout and "resnet" in show.stdout
