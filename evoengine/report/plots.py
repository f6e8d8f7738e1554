"""The report's two plots per workload, drawn with matplotlib as inline SVG text.

Each plot is a ``Figure`` rendered to SVG in memory (the Agg backend: nothing opens a
display), with text kept as text (smaller, searchable) and ids salted per plot, so several
SVGs in one HTML page never share an id and the same data gives the same bytes.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # before any pyplot import anywhere in this process: never a display

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import LogLocator, ScalarFormatter  # noqa: E402

from evoengine.report.gather import ANCHOR_NAMES, WorkloadReport  # noqa: E402

_OURS = "#1f6fb4"
_ANCHOR_COLOURS = {"flash": "#9a9a9a", "cudnn": "#6b6b6b", "fa4": "#c0392b"}


def svg(fig: Figure, salt: str) -> str:
    """``fig`` as an ``<svg>`` element (no XML prolog), its ids salted with ``salt``."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):].strip()


def progression(w: WorkloadReport) -> str:
    """Best valid time against evaluations, one step line per study, and the final
    re-time's anchors as horizontal lines for scale."""
    return svg(progression_figure(w), f"progress-{w.anchor}")


def anchors(w: WorkloadReport) -> str:
    """Ours next to each anchor timed in the same final re-time, as horizontal bars (µs,
    shorter is faster), each anchor labelled with how fast ours is against it."""
    return svg(anchors_figure(w), f"anchors-{w.anchor}")


def progression_figure(w: WorkloadReport) -> Figure:
    fig = Figure(figsize=(7.0, 3.6))
    ax = fig.add_subplot()
    for p in w.progressions:
        xs = [i + 1 for i, b in enumerate(p.best_us) if b is not None]
        ys = [b for b in p.best_us if b is not None]
        if xs:
            ax.step(xs, ys, where="post", label=p.study, linewidth=1.6)
    if w.final is not None:
        for anchor, us in w.final.anchors_us.items():
            if us:
                ax.axhline(us, linestyle=":", linewidth=1.0,
                           color=_ANCHOR_COLOURS.get(anchor, "#444444"),
                           label=f"{ANCHOR_NAMES.get(anchor, anchor)} (final re-time)")
    ax.set_xlabel("evaluations")
    ax.set_ylabel("best valid time (µs, log scale)")
    ax.set_yscale("log")  # the first points are often 10x the last: keep the end readable
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no valid evaluation", ha="center", va="center",
                transform=ax.transAxes)
    return fig


def anchors_figure(w: WorkloadReport) -> Figure:
    assert w.final is not None
    f = w.final
    names = ["ours"]
    times = [f.ours_us]
    colours = [_OURS]
    for anchor, us in f.anchors_us.items():
        if us:
            names.append(ANCHOR_NAMES.get(anchor, anchor))
            times.append(us)
            colours.append(_ANCHOR_COLOURS.get(anchor, "#444444"))
    fig = Figure(figsize=(7.0, 0.6 + 0.45 * len(names)))
    ax = fig.add_subplot()
    ys = list(range(len(names)))[::-1]
    ax.barh(ys, times, color=colours, height=0.6)
    ax.set_yticks(ys, names)
    for y, us, name in zip(ys, times, names, strict=True):
        label = f"{us:.1f} µs"
        if name != "ours":
            label += f"  (ours {us / f.ours_us:.3f}x as fast)"
        ax.text(us, y, f" {label}", va="center", fontsize=8)
    ax.set_xlim(0, max(times) * 1.35)
    ax.set_xlabel("time (µs), final re-time, interleaved in one process")
    ax.grid(True, axis="x", alpha=0.3)
    return fig
