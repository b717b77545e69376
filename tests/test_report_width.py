"""The report's tables fit a 1280 px window: numbers keep to a line, a CI may go below its
estimate, sentences wrap, and a column with no value is left out."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from speedbench.report.document import html_table
from speedbench.report.render import summary_table

ROOT = Path(__file__).resolve().parents[1]


def test_a_ci_may_wrap_below_its_estimate_and_a_sentence_of_a_verdict_wraps():
    table = pd.DataFrame({"speed-up": ["1.07x [0.948, 1.22]", "1.00x"],
                          "verdict": ["faster", "n/a: the claim is stated for CUDA GPUs"]})
    html = html_table(table)
    assert '<td class="num ci">1.07x <span class="nw">[0.948, 1.22]</span></td>' in html
    assert '<td class="num">1.00x</td>' in html
    assert '<td class="verdict good">faster</td>' in html
    assert '<td class="verdict na long">n/a: the claim is stated' in html


def test_a_summary_column_with_no_value_in_any_row_is_left_out():
    from speedbench.analysis.summary import summarise
    from test_report_figures import trials_frame

    summary = summarise(trials_frame(statuses={"fp16": "error: ValueError: x"}))
    table = summary_table(summary)
    assert "GFLOP/s" not in table and "samples/s" in table  # no FLOP count here
    failed = summary_table(summary[summary["variant"] == "fp16"])
    assert list(failed.columns[:3]) == ["model", "variant", "status"]
    assert "samples/s" not in failed and "verdict" in failed


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OVERFLOW = ("<script>document.body.dataset.overflow = [...document.querySelectorAll('.scroll')]"
            ".filter(d => d.scrollWidth > d.clientWidth + 1).length;</script>")


@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium")
def test_the_reference_reports_tables_fit_a_1280_px_window(tmp_path):
    """The reference run's report, rebuilt, in headless Chromium at 1280 px: no table needs
    its scroll bar (the summary has 14 columns, its CIs the widest cells)."""
    from speedbench.report.__main__ import main as report

    assert report([str(ROOT / "results" / "reference" / "cpu-epyc-2core"),
                   "--out", str(tmp_path)]) == 0
    page = tmp_path / "report.html"
    page.write_text(page.read_text().replace("</body>", OVERFLOW + "</body>"))
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--window-size=1280,2000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'data-overflow="(\d+)"', out.stdout)
    assert found, out.stderr[-2000:]
    assert found.group(1) == "0"


def test_a_number_like_cell_in_a_column_of_words_is_aligned_with_its_words():
    """The arms' software table: "13.0" (a CUDA runtime) sat right-aligned among versions and
    paths; a column of numbers still aligns them right."""
    from speedbench.report.document import html_table

    table = pd.DataFrame({"": ["torch", "CUDA runtime (wheel)"], "a": ["2.14.1+cu130", "13.0"],
                          "speed-up": ["1.10x [1.02, 1.19]", "0.98x"]})
    html = html_table(table)
    assert "<td>13.0</td>" in html and 'class="num' in html.split("13.0")[1]
