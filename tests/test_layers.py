"""The import contracts in pyproject.toml ([tool.importlinter]) hold: layers without circles,
and a report that imports neither torch nor training code. A violation fails this test with
import-linter's account of the offending import chain."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

importlinter_cli = pytest.importorskip("importlinter.cli", reason="pip install import-linter")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_are_kept(capsys):
    # grimp analyses the speedbench these tests import (PYTHONPATH=src in a checkout).
    status = importlinter_cli.lint_imports(config_filename=str(PYPROJECT), no_cache=True,
                                           no_logo=True)
    out = capsys.readouterr().out
    assert status == importlinter_cli.EXIT_STATUS_SUCCESS, out
    assert "0 broken" in out


def test_a_broken_layer_is_caught(tmp_path):
    """The contract has teeth: a config that forbids what the code does is reported broken."""
    broken = tmp_path / "pyproject.toml"
    broken.write_text('[tool.importlinter]\nroot_package = "speedbench"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
                      'containers = ["speedbench"]\nlayers = ["config", "run"]\n')
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        status = importlinter_cli.lint_imports(config_filename=str(broken), no_cache=True,
                                               no_logo=True)
    finally:
        os.chdir(cwd)
    assert status != importlinter_cli.EXIT_STATUS_SUCCESS
