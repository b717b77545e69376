"""Text formats shared by the report, the console and the recommendation (a ratio with its
interval: analysis/numbers.py's ratio_text)."""
from __future__ import annotations

import math


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
