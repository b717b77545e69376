"""The one text of a ratio with its interval, `1.50x [1.36, 1.66]`, for every layer that writes
one (the report, the console, the search's progress, the techniques' bounds). No imports of the
package: analysis is the lowest layer that all of them may import (pyproject.toml)."""
from __future__ import annotations

import math
from typing import Optional

AUTO = "auto"  # two decimals where that reads well, else 3 significant digits


def _number(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _format(x: float, spec: str) -> str:
    if spec == AUTO:  # a CI from two rounds can span decades: 1.2e+10, not 12345678901.00
        spec = ".2f" if 0.01 <= abs(x) < 100 else ".3g"
    return format(x, spec)


# An interval whose ends are this far apart (1e-08 to 9.6e+07 after two noisy rounds) says
# nothing a reader can use: it is printed as such, not as digits.
USELESS_SPAN = 1000.0


def ratio_text(value, lo=None, hi=None, spec: str = ".2f", ci_spec: Optional[str] = None,
               unit: str = "x", sep: str = ", ") -> str:
    """`1.50x [1.36, 1.66]`; `1.50x` when the interval is missing or not finite; `-` without a
    finite value. `spec` formats the value (".2f", ".3g", ... or AUTO), `ci_spec` the bounds
    (default: `spec`); `unit` follows the value, `sep` parts the bounds."""
    x, low, high = _number(value), _number(lo), _number(hi)
    if not math.isfinite(x):
        return "-"
    text = _format(x, spec) + unit
    if not (math.isfinite(low) and math.isfinite(high)):
        return text
    if low > 0 and high / low > USELESS_SPAN:  # two rounds at a strict level: no information
        return f"{text} [no useful interval]"
    ci_spec = spec if ci_spec is None else ci_spec
    return f"{text} [{_format(low, ci_spec)}{sep}{_format(high, ci_spec)}]"
