"""Charts of a benchmark report.

- ``headroom.svg`` (no dependencies): every budget's headroom (x times inside it; 1 is the
  line), on a log scale so a 40x win and a 0.1x miss both stay readable; green met, red missed.
- PNGs (matplotlib, the optional ``plots`` extra; skipped without it), one per question:
  ``overhead_parts.png`` (where the pipeline's per-request overhead goes, from ``pipeline``),
  ``throughput.png`` (requests/s and efficiency vs encode workers and image size, from
  ``throughput``), ``prefill_bytes.png`` (the prefill path's bytes vs full ``kwargs_data``, log
  scale, from ``prefill_bytes``). A chart whose benchmark is not in the report is not drawn.

``python -m bench.plot RESULTS.json [DIR]`` redraws the PNGs from a saved report.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from html import escape
from pathlib import Path
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


# --- PNG charts (matplotlib) -------------------------------------------------------------------

OVERHEAD_PARTS = (
    ("fanout_ms", "fan-out"),
    ("encode_hop_ms", "broker hop to encode"),
    ("prefill_hop_ms", "broker hop to prefill"),
    ("prefill_queue_ms", "prefill queue"),
    ("prefill_admission_ms", "prefill reads"),
    ("embedding_wait_ms", "embedding wait"),
    ("finished_to_seen_ms", "result to client"),
    ("overhead_ms", "overhead (total)"),
    ("model_compute_ms", "model compute"),
)
"""Parts of the ``pipeline`` overhead block, in request order, then the totals."""


def pipeline_blocks(pipeline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each broker's block of a ``pipeline`` report (one unnamed block in older reports)."""
    return pipeline.get("brokers") or {"": pipeline}


SERIES_COLORS = {
    ("miss", 0): "#4c72b0",
    ("hit", 0): "#dd8452",
    ("miss", 1): "#8fa8d6",
    ("hit", 1): "#f0b88a",
}


def _overhead_parts(report: dict[str, Any], plt: Any) -> Any:
    blocks = pipeline_blocks(report["pipeline"])
    series = [(broker, case) for broker in blocks for case in ("miss", "hit")]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(OVERHEAD_PARTS) * len(series) / 2))
    labels = [label for _, label in OVERHEAD_PARTS]
    width = 0.8 / len(series)
    for i, (broker, case) in enumerate(series):
        rows = blocks[broker]["overhead"].get(case, {})
        # A part this case does not have (a cached image is never encoded) is marked n/a.
        found = [rows.get(key, {}).get("p50_ms") for key, _ in OVERHEAD_PARTS]
        values = [v or 0.0 for v in found]
        ys = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        name = "new image" if case == "miss" else "cached image"
        shade = list(blocks).index(broker) % 2
        label = f"{broker_label(broker)}{name} (p50)"
        ax.barh(ys, values, height=width, color=SERIES_COLORS[(case, shade)], label=label)
        for y, v in zip(ys, found, strict=True):
            text = " n/a" if v is None else (f" {v:.3g}" if v >= 0.01 else " 0")
            ax.text(v or 0.0, y, text, va="center", fontsize=7)
    budget_ms = report["pipeline"].get("budget", {}).get("max_overhead_p50_ms")
    if budget_ms:
        ax.axvline(budget_ms, color="black", linestyle="--", linewidth=1)
        ax.text(budget_ms, len(labels) - 0.4, f" budget {budget_ms:g} ms", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per request (p50)")
    ax.set_title("Pipeline overhead by part, per broker (one request at a time, tiny model)")
    ax.legend(loc="lower right", fontsize=7)
    return fig


def broker_label(broker: str) -> str:
    names = {"apache": "Apache Kafka: ", "tansu": "Tansu: ", "env": "env broker: "}
    return names.get(broker, "")


def _throughput(report: dict[str, Any], plt: Any) -> Any:
    cells = report["throughput"]["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for workers in sorted({c["encode_workers"] for c in cells}):
        mine = sorted((c for c in cells if c["encode_workers"] == workers), key=lambda c: c["side"])
        xs = [f"{c['side']}²" for c in mine]
        label = f"{workers} encode worker{'s' if workers > 1 else ''}"
        left.plot(xs, [c["requests_per_s"] for c in mine], marker="o", label=label)
        right.plot(xs, [c["efficiency"] for c in mine], marker="o", label=label)
    left.set_ylabel("requests/s (sustained)")
    left.set_xlabel("image size")
    left.set_ylim(bottom=0)
    left.set_title("Throughput")
    right.set_ylabel("model busy / wall, busiest worker")
    right.set_xlabel("image size")
    right.set_ylim(0, 1.05)
    right.set_title("Pipeline efficiency")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Whole pipeline, tiny model, {report['throughput']['partitions']} partitions")
    return fig


def _prefill_bytes(report: dict[str, Any], plt: Any) -> Any:
    block = report["prefill_bytes"]["qwen2vl_ids"]
    rows = [
        ("ours: prefill record batch (sent)", block["ours_prefill_record_batch_bytes"]),
        ("ours: PrefillEvent (uncompressed)", block["ours_prefill_event_bytes"]),
        ("vLLM JSON, metadata only", report["prefill_bytes"]["vllm_json_metadata_only_bytes"]),
        ("Avro + full kwargs_data (bf16)", block["bf16"]["avro_full_kwargs_bytes"]),
        ("Avro + full kwargs_data (fp32)", block["fp32"]["avro_full_kwargs_bytes"]),
        ("vLLM JSON + full kwargs_data (fp32)", block["fp32"]["vllm_json_full_kwargs_bytes"]),
    ]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = ["#3a9d3a"] * 2 + ["#8c8c8c"] + ["#c83737"] * 3
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=colors)
    for i, (_, v) in enumerate(rows):
        ax.text(v, i, f" {v:,}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(100, 10**9)
    ax.invert_yaxis()
    ax.set_xlabel("bytes on the prefill path, one 1024² image (log scale)")
    ax.set_title(
        f"Prefill bytes: {block['fp32']['ratio_vs_avro_full']:,.0f}x smaller than full kwargs"
    )
    return fig


CHARTS: dict[str, tuple[str, Callable[[dict[str, Any], Any], Any]]] = {
    "overhead_parts.png": ("pipeline", _overhead_parts),
    "throughput.png": ("throughput", _throughput),
    "prefill_bytes.png": ("prefill_bytes", _prefill_bytes),
}
"""PNG file -> (the benchmark it needs, the function drawing it)."""


def write_pngs(report: dict[str, Any], out: Path) -> list[Path]:
    """Draw every chart whose benchmark ran without error into ``out``; the files written.

    Nothing (an empty list) without matplotlib: the charts are an optional extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name, (bench, draw) in CHARTS.items():
        block = report.get(bench)
        if not isinstance(block, dict) or "error" in block:
            continue
        fig = draw(report, plt)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


if __name__ == "__main__":
    results = Path(sys.argv[1])
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else results.parent
    for path in write_pngs(json.loads(results.read_text()), target):
        print(path)
