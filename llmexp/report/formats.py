"""The value formats every report shares."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def fmt(value: Any, digits: int = 4) -> str:
    """A value for a report's table: `–` when unknown, learning rates as 3e-04 rather than 0.0003."""
    if not isinstance(value, float):
        return "–" if value is None else str(value)
    if math.isfinite(value) and 0 < abs(value) < 1e-2:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    return f"{value:.{digits}g}"  # (inf and nan as str() writes them)


def is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def fmt_rate(value: Any) -> str:
    """A throughput (tokens/s): whole numbers with thousands separators read at a glance."""
    return f"{value:,.0f}" if is_finite(value) else fmt(value)


def md_table(header: list[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def md_cell(text: Any) -> str:
    """Text as a table cell: one row each, its pipes escaped."""
    return str(text).replace("|", "\\|").replace("\n", "⏎ ")


def fmt_params(n: float) -> str:
    """A parameter or token count at a glance: 147.8K, 1.3B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
