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
