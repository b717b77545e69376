"""A report as a list of blocks, rendered to Markdown and to one self-contained HTML file.

Every string that reaches the HTML passes through html.escape here, in one place: values from
configs, environments and CSV files are data, never markup.
"""
from __future__ import annotations

import base64
import hashlib
import html
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from speedbench.results import atomic

# Verdict words → the colour class of their table cell.
GOOD = ("faster", "holds")
BAD = ("slower", "does not hold", "oom", "diverged", "error")
MIXED = ("partly", "inconclusive", "too few trials", "no baseline")
NUMERIC = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(x|%| MB)?( \[.*\])?$")

MOST_CHARS = 200  # a value from a run's files in a table cell, at most (shortened)


def shortened(text: str, most: int = MOST_CHARS) -> str:
    """`text`, cut to about `most` characters, saying how long it was: a report is read, and
    one huge value (an environment variable of 50 MB) must not make it huge."""
    return text if len(text) <= most else f"{text[:most - 30]}… ({len(text):,} characters)"


@dataclass
class Document:
    title: str
    subtitle: str = ""
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", level, text))

    def para(self, text: str) -> None:
        self.blocks.append(("para", text))

    def lead(self, text: str) -> None:
        """The sentence to read first: highlighted."""
        self.blocks.append(("lead", text))

    def quote(self, text: str, source: str) -> None:
        self.blocks.append(("quote", text, source))

    def note(self, text: str) -> None:
        self.blocks.append(("note", text))

    def bullets(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("bullets", list(items)))

    def pairs(self, items: list[tuple[str, str]]) -> None:
        self.blocks.append(("pairs", list(items)))

    def table(self, df: pd.DataFrame) -> None:
        self.blocks.append(("table", df))

    def code(self, text: str, caption: str = "") -> None:
        """A block of code, shown as is (Python)."""
        self.blocks.append(("code", text, caption))

    def figures(self, items: list[tuple[str, str]]) -> None:
        """(caption, path relative to the report) of PNG files, shown side by side if they fit."""
        if items:
            self.blocks.append(("figures", list(items)))


def slug(text: str) -> str:
    """A safe file-name and anchor fragment for any string; one that had to change (`exp/one`)
    gets a short hash of the whole, so that two names never share a figure (`exp-one`)."""
    text = str(text)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:60] or "x"
    if safe == text:
        return safe
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[:50]}-{digest}"


# --- Markdown ---------------------------------------------------------------------------------

def _md_cell(value) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    # `]` escaped where a link would start (`](`, `][`, `]:`): names never become links
    text = re.sub(r"\](?=\s*[(\[:])", r"\\]", text)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def markdown_table(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(_md_cell(c) for c in df.columns) + " |",
             "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |"
              for row in df.itertuples(index=False)]
    return "\n".join(lines)


def to_markdown(doc: Document) -> str:
    out = [f"# {_md_cell(doc.title)}", ""]
    if doc.subtitle:
        out += [_md_cell(doc.subtitle), ""]
    for block in doc.blocks:
        kind = block[0]
        if kind == "heading":
            out += ["#" * block[1] + " " + _md_cell(block[2]), ""]
        elif kind == "para":
            out += [_md_cell(block[1]), ""]
        elif kind == "lead":
            out += [f"**{_md_cell(block[1])}**", ""]
        elif kind == "quote":
            out += [f"> {_md_cell(block[1])}", ">", f"> — {_md_cell(block[2])}", ""]
        elif kind == "note":
            out += [f"> {_md_cell(block[1])}", ""]
        elif kind == "bullets":
            out += [f"- {_md_cell(b)}" for b in block[1]] + [""]
        elif kind == "pairs":
            out += [f"- **{_md_cell(k)}**: {_md_cell(v)}" for k, v in block[1]] + [""]
        elif kind == "table":
            out += [markdown_table(block[1]) if len(block[1]) else "(none)", ""]
        elif kind == "figures":
            out += [f"![{_md_cell(c)}]({p})" for c, p in block[1]] + [""]
        elif kind == "code":
            out += ([f"*{_md_cell(block[2])}*", ""] if block[2] else []) + \
                ["```python", block[1].replace("```", "` ` `"), "```", ""]
    return "\n".join(out)


# --- HTML -------------------------------------------------------------------------------------

def _cell_class(column: str, text: str) -> str:
    if "verdict" in column.lower():
        low = text.lower()
        for words, cls in ((GOOD, "good"), (BAD, "bad"), (MIXED, "mixed")):
            if any(low.startswith(w) for w in words):
                return "verdict " + cls
        if low.startswith("n/a"):
            return "verdict na"
        return "verdict"
    return "num" if NUMERIC.match(text) else ""


LONG_VERDICT = 24  # characters: a verdict cell longer than this wraps (td.long)


def html_table(df: pd.DataFrame) -> str:
    """A table that fits the page: numbers and verdict words keep to one line, an estimate's
    CI may go below it, and sentences wrap (the scroll box is for a narrow window)."""
    e = html.escape
    head = "".join(f"<th>{e(str(c))}</th>" for c in df.columns)
    # a column of words with a number-like cell (a version, "13.0") keeps that cell with them
    words = {i for i in range(df.shape[1]) if not all(
        NUMERIC.match(str(v)) or str(v) in ("-", "", "nan", "n/a") for v in df.iloc[:, i])}
    rows = []
    for row in df.itertuples(index=False):
        cells = []
        for i, (col, value) in enumerate(zip(df.columns, row)):
            text = str(value)
            cls = _cell_class(str(col), text)
            if cls == "num" and i in words:
                cls = ""
            body = e(text)
            if cls == "num" and " [" in text:  # the estimate may wrap above its CI
                est, ci = text.split(" [", 1)
                cls, body = "num ci", f'{e(est)} <span class="nw">[{e(ci)}</span>'
            elif cls.startswith("verdict") and len(text) > LONG_VERDICT:
                cls += " long"  # a sentence (n/a: why), not a word: it wraps
            cells.append(f'<td class="{cls}">{body}</td>' if cls else f"<td>{body}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG from its IHDR chunk."""
    return struct.unpack(">II", data[16:24])


def _img(base: Path, path: str, caption: str, dpi: int) -> str:
    data = (base / path).read_bytes()
    w, _ = _png_size(data)
    css_w = round(w * 96 / dpi)  # the figure's size in inches at 96 CSS px per inch
    src = "data:image/png;base64," + base64.b64encode(data).decode()
    return (f'<figure style="max-width:{css_w}px"><img alt="{html.escape(caption)}" '
            f'src="{src}" width="{css_w}"><figcaption>{html.escape(caption)}</figcaption></figure>')


STYLE = """
:root{--ink:#1d2935;--muted:#5c6b7a;--line:#e3e8ee;--bg:#f6f8fa;--good:#1f7a6f;--bad:#c4512f;
--mixed:#9a6b00}
*{box-sizing:border-box}
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink);
margin:0;background:var(--bg)}
header{background:#264653;color:#fff;padding:28px 40px 22px}
header h1{margin:0;font-size:26px;font-weight:650}
header p{margin:6px 0 0;color:#cfe3ea}
nav{padding:8px 40px;background:#fff;border-bottom:1px solid var(--line);font-size:14px;
position:sticky;top:0;z-index:1}
nav a{margin-right:18px;color:#2a6f86;text-decoration:none}
main{max-width:1240px;margin:0 auto;padding:8px 32px 40px}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:6px 24px 18px;
margin:22px 0}
h2{font-size:20px;margin:18px 0 10px;border-bottom:2px solid var(--line);padding-bottom:6px}
h3{font-size:16px;margin:20px 0 8px;color:#2a6f86}
.scroll{overflow-x:auto}
table{border-collapse:collapse;margin:8px 0 14px;font-size:13.5px}
th{background:var(--bg);text-align:left;font-weight:600;border-bottom:2px solid var(--line)}
td,th{padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
tbody tr:hover{background:#fafcfd}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.ci{white-space:normal}
td.verdict{font-weight:600;white-space:nowrap}
td.verdict.long{white-space:normal;min-width:12em}
.nw{white-space:nowrap}
td.good{color:var(--good)}td.bad{color:var(--bad)}td.mixed{color:var(--mixed)}
td.na{color:var(--muted);font-weight:400}
dl{display:grid;grid-template-columns:max-content 1fr;gap:3px 18px;margin:10px 0}
dt{color:var(--muted)}dd{margin:0}
.note{background:#fff8e6;border-left:4px solid #e9c46a;padding:8px 14px;margin:10px 0;
border-radius:4px}
.figs{display:flex;flex-wrap:wrap;gap:18px;margin:10px 0}
figure{margin:0;flex:1 1 auto}
figure img{width:100%;height:auto;border:1px solid var(--line);border-radius:6px}
figcaption{color:var(--muted);font-size:13px;margin-top:4px}
ul{margin:6px 0 12px}
pre{background:var(--bg);border:1px solid var(--line);border-radius:6px;padding:8px 12px;
overflow-x:auto;font-size:13px}
.lead{background:#eef6f8;border-left:4px solid #2a9d8f;padding:10px 14px;border-radius:4px}
blockquote{margin:18px 0 4px;padding:8px 16px;border-left:4px solid #8d99ae;background:var(--bg);
font-style:italic;border-radius:4px}
blockquote cite{display:block;font-style:normal;color:var(--muted);font-size:13px;margin-top:4px}
"""


def to_html(doc: Document, base: Path, dpi: int) -> str:
    """One self-contained page: styles inline, figures embedded as base64 PNG."""
    e = html.escape
    body, nav, open_section = [], [], False
    for block in doc.blocks:
        kind = block[0]
        if kind == "heading" and block[1] == 2:
            if open_section:
                body.append("</section>")
            anchor = f"s{len(nav)}-{slug(block[2])}"
            nav.append(f'<a href="#{anchor}">{e(block[2])}</a>')
            body.append(f'<section id="{anchor}"><h2>{e(block[2])}</h2>')
            open_section = True
        elif kind == "heading":
            body.append(f"<h{block[1]}>{e(block[2])}</h{block[1]}>")
        elif kind == "para":
            body.append(f"<p>{e(block[1])}</p>")
        elif kind == "lead":
            body.append(f'<p class="lead">{e(block[1])}</p>')
        elif kind == "quote":
            body.append(f"<blockquote>{e(block[1])}<cite>{e(block[2])}</cite></blockquote>")
        elif kind == "note":
            body.append(f'<div class="note">{e(block[1])}</div>')
        elif kind == "bullets":
            body.append("<ul>" + "".join(f"<li>{e(b)}</li>" for b in block[1]) + "</ul>")
        elif kind == "pairs":
            body.append("<dl>" + "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>"
                                         for k, v in block[1]) + "</dl>")
        elif kind == "table":
            body.append(html_table(block[1]) if len(block[1]) else "<p>(none)</p>")
        elif kind == "code":
            body.append((f"<p><em>{e(block[2])}</em></p>" if block[2] else "")
                        + f"<pre><code>{e(block[1])}</code></pre>")
        elif kind == "figures":
            body.append('<div class="figs">' + "".join(_img(base, p, c, dpi)
                                                      for c, p in block[1]) + "</div>")
    if open_section:
        body.append("</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{e(doc.title)}</title><style>{STYLE}</style></head><body>"
            f"<header><h1>{e(doc.title)}</h1><p>{e(doc.subtitle)}</p></header>"
            f"<nav>{''.join(nav)}</nav><main>{''.join(body)}</main></body></html>\n")


def write(doc: Document, out_dir: Path, dpi: int) -> Path:
    """report.md and report.html in out_dir; returns the path of report.html."""
    # both or neither: a full disk must not leave a new report.md beside an old report.html
    atomic.write_files({out_dir / "report.md": to_markdown(doc).encode("utf-8"),
                        out_dir / "report.html": to_html(doc, out_dir, dpi).encode("utf-8")})
    return out_dir / "report.html"
