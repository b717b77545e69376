"""Number formats shared by the report, the console and the recommendation."""
from __future__ import annotations

import math


def ratio(x: float) -> str:
    """A ratio with two decimals where that reads well, else 3 significant digits (a CI from
    two rounds can span decades: 1.2e+10, not 12345678901.00)."""
    return f"{x:.2f}" if 0.01 <= abs(x) < 100 else f"{x:.3g}"


def ratio_ci(x, lo, hi, unit: str = "x") -> str:
    """`1.50x [1.36, 1.66]`; `-` without a value; no brackets without a finite CI."""
    if x is None or not math.isfinite(x):
        return "-"
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{ratio(x)}{unit}"
    return f"{ratio(x)}{unit} [{ratio(lo)}, {ratio(hi)}]"


def clip(text: str, most: int) -> str:
    """`text` within `most` characters, cut at a word's end with an ellipsis, never mid-word."""
    text = str(text)
    if len(text) <= most:
        return text
    cut = text[:most].rsplit(" ", 1)[0] if " " in text[:most] else text[:most - 1]
    return cut.rstrip(" ,;:(") + "…"


def learning_lost(row: dict) -> str:
    """`+2 % [-30, +41] of 1.9 nats`: the share of the baseline's learning a variant lost
    (analysis/quality.py), its CI, and what the baseline learned; "-" without it."""
    try:
        lost, lo, hi, nats = (float(row.get(k, math.nan)) for k in (
            "learning_lost", "learning_lost_lo", "learning_lost_hi", "learned_nats"))
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(lost):
        return "-"
    ci = f" [{100 * lo:+.0f}, {100 * hi:+.0f}]" if math.isfinite(lo) and math.isfinite(hi) \
        else ""
    return f"{100 * lost:+.0f} %{ci} of {nats:.2g} nats"
