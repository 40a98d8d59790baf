"""A dependency-free SVG chart of every budget's headroom (x times inside it; 1 is the line).

Headroom is plotted on a log scale so a 40x win and a 0.1x miss both stay readable. Bars that
reach the line are green, bars that fall short are red.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

WIDTH = 760
ROW = 26
LEFT = 300
PLOT = WIDTH - LEFT - 80
LO, HI = 0.01, 1000.0  # the log axis spans 1/100x .. 1000x


def _x(value: float) -> float:
    v = min(max(value, LO), HI)
    return LEFT + PLOT * (math.log10(v) - math.log10(LO)) / (math.log10(HI) - math.log10(LO))


def headroom_rows(report: dict[str, Any]) -> list[tuple[str, float]]:
    """``(benchmark.metric, headroom)`` for every benchmark that reported a headroom block."""
    rows = []
    for name, block in report.items():
        if isinstance(block, dict) and isinstance(block.get("headroom"), dict):
            for metric, value in block["headroom"].items():
                if isinstance(value, int | float) and value > 0:
                    rows.append((f"{name}.{metric}", float(value)))
    return rows


def headroom_svg(report: dict[str, Any]) -> str:
    """The chart as SVG text."""
    rows = headroom_rows(report)
    height = 50 + ROW * max(len(rows), 1) + 30
    one = _x(1.0)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">epd-pipeline budgets: headroom (x inside budget, '
        f"log scale; quick={escape(str(report.get('options', {}).get('quick')))})</text>",
    ]
    for i, (label, value) in enumerate(rows):
        y = 40 + i * ROW
        x = _x(value)
        color = "#3a9d3a" if value >= 1.0 else "#c83737"
        left, right = sorted((one, x))
        parts.append(f'<text x="10" y="{y + 15}">{escape(label)}</text>')
        parts.append(
            f'<rect x="{left:.1f}" y="{y + 3}" width="{max(right - left, 1):.1f}" height="16" '
            f'fill="{color}"/>'
        )
        parts.append(f'<text x="{max(x, one) + 4:.1f}" y="{y + 15}">{value:.3g}x</text>')
    bottom = 40 + ROW * max(len(rows), 1)
    parts.append(f'<line x1="{one:.1f}" y1="32" x2="{one:.1f}" y2="{bottom}" stroke="black"/>')
    for tick in (0.01, 0.1, 1, 10, 100, 1000):
        tx = _x(tick)
        parts.append(f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle">{tick:g}x</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
