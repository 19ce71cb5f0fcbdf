"""The figures of the HTML reports, drawn with matplotlib and returned as inline SVG text.

No pyplot (no global backend, no GUI): a `Figure` on the SVG canvas, written to a string. Text stays
text (`svg.fonttype: none`), so the figures are small and searchable, and each figure's ids are salted
with its own name, so several figures on one page never share an id. The SVG's metadata block (creator,
date, a link to the matplotlib site) is left out: the page refers to nothing outside itself.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from llmopt.errors import LlmoptError

_NO_METADATA = {"Creator": None, "Date": None, "Format": None, "Type": None}


@contextmanager
def _figure(name: str, size: tuple[float, float]):
    try:
        import matplotlib
        from matplotlib.backends.backend_svg import FigureCanvasSVG
        from matplotlib.figure import Figure
    except ImportError:
        raise LlmoptError("--html needs matplotlib: pip install matplotlib (or the llmopt bench extra)") from None
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"llmopt-{name}", "font.size": 9}):
        fig = Figure(figsize=size, layout="constrained")
        FigureCanvasSVG(fig)
        yield fig


_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r"#([A-Za-z_][\w.\-]*)")


def _svg(fig: Any, name: str) -> str:
    """The figure as inline SVG: no XML declaration or DOCTYPE, every id (and reference to it) prefixed
    with the figure's name, since matplotlib numbers its groups `figure_1`, `axes_1`, ... in every file."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=_NO_METADATA)
    text = buf.getvalue()
    text = text[text.index("<svg"):].strip()
    ids = set(_ID.findall(text))
    text = _ID.sub(lambda m: f'id="{name}-{m.group(1)}"', text)
    return _REF.sub(lambda m: f"#{name}-{m.group(1)}" if m.group(1) in ids else m.group(0), text)


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def cdf_svg(name: str, series: Sequence[tuple[str, Sequence[float]]], xlabel: str, title: str) -> str | None:
    """Empirical CDFs, one step line per series (e.g. per load level); None when no series has data."""
    data = [(label, sorted(_finite(v))) for label, v in series]
    data = [(label, v) for label, v in data if v]
    if not data:
        return None
    with _figure(name, (6.4, 3.6)) as fig:
        ax = fig.subplots()
        for label, v in data:
            n = len(v)
            ax.step([v[0], *v], [0.0, *[(i + 1) / n for i in range(n)]], where="post", label=f"{label} (n={n})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
        return _svg(fig, name)


def curve_svg(name: str, points: Sequence[tuple[str, float | None, float]], knee: tuple[float, float] | None,
              xlabel: str, knee_label: str = "knee") -> str | None:
    """Throughput (y) against latency (x), one labelled point per load level, the knee starred."""
    pts = [(label, x, y) for label, x, y in points if x is not None and math.isfinite(x)]
    if not pts:
        return None
    with _figure(name, (6.4, 3.8)) as fig:
        ax = fig.subplots()
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o")
        for label, x, y in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
        if knee is not None:
            ax.plot([knee[0]], [knee[1]], marker="*", markersize=16, color="#d62728", linestyle="none",
                    label=knee_label)
            ax.legend(loc="lower right")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_title("throughput vs latency")
        ax.grid(True, alpha=0.3)
        return _svg(fig, name)


def bars_svg(name: str, labels: Sequence[int | str], values: Sequence[float], highlight: set, title: str,
             xlabel: str, ylabel: str, reference: tuple[float, str] | None = None) -> str:
    """A bar per label (highlighted ones in red), optionally a dashed reference line."""
    with _figure(name, (max(6.0, 0.25 * len(labels) + 2), 3.4)) as fig:
        ax = fig.subplots()
        xs = list(range(len(labels)))
        ax.bar(xs, list(values), color=["#d62728" if lab in highlight else "#1f77b4" for lab in labels])
        if reference is not None:
            ax.axhline(reference[0], color="gray", linestyle="--", linewidth=1, label=reference[1])
            ax.legend(loc="upper right")
        step = 1 if len(labels) <= 40 else 2
        ax.set_xticks(xs[::step], [str(lab) for lab in labels][::step])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        return _svg(fig, name)


def stacked_bar_svg(name: str, parts: Sequence[tuple[str, float]], capacity: float | None, unit: str,
                    title: str) -> str:
    """One horizontal bar split into parts (e.g. weights, KV cache, activations, reserve) against a capacity."""
    with _figure(name, (7.0, 2.4)) as fig:
        ax = fig.subplots()
        left = 0.0
        colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
        for i, (label, value) in enumerate(parts):
            ax.barh([0], [value], left=left, color=colors[i % len(colors)], label=f"{label} {value:.3g} {unit}")
            left += value
        if capacity is not None:
            ax.axvline(capacity, color="#d62728", linewidth=2, label=f"capacity {capacity:.3g} {unit}")
        ax.set_yticks([])
        ax.set_xlabel(unit)
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=3, fontsize=7, frameon=False)
        return _svg(fig, name)


def intervals_svg(name: str, rows: Sequence[tuple[str, float, float | None, float | None]], reference: float,
                  xlabel: str, title: str) -> str | None:
    """A point and its interval per row (a forest plot), with a dashed line at `reference` (1.0 for ratios)."""
    rows = [r for r in rows if r[1] is not None and math.isfinite(r[1])]
    if not rows:
        return None
    with _figure(name, (6.4, 0.32 * len(rows) + 1.2)) as fig:
        ax = fig.subplots()
        ys = list(range(len(rows)))[::-1]
        for y, (_, point, low, high) in zip(ys, rows, strict=True):
            if low is not None and high is not None:
                ax.plot([low, high], [y, y], color="#1f77b4", linewidth=2)
            ax.plot([point], [y], marker="o", color="#1f77b4")
        ax.axvline(reference, color="gray", linestyle="--", linewidth=1)
        ax.set_yticks(ys, [r[0] for r in rows])
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
        return _svg(fig, name)
