"""PNG plots: the headline ratios of every sweep with their intervals, and each sweep's tok/s.

Each PNG carries a `Source-Digest` text chunk (a hash of exactly the figures it draws), so
`publish --check` can tell a stale plot from a fresh one without rendering or comparing pixels,
which differ between font and freetype builds."""
from __future__ import annotations

import hashlib
import io
import json

from benchmarks import ratios as R
from benchmarks.table import Table
from benchmarks.workloads import BY_NAME as WORKLOADS

PLOT_VERSION = 2
RATIOS_PNG = "ratios.png"
COLORS = {"ours": "#1f77b4", "peer": "#ff7f0e"}


def throughput_png(t: Table) -> str:
    return f"throughput-{t.name}.png"


def ratios_data(tables: list[Table]) -> dict:
    """{sweep: [(label, median, lo, hi, resolved)]} of the headline ratios."""
    out = {}
    for t in tables:
        rows = []
        for spec in R.HEADLINE:
            res = R.compute(t, spec)
            if res is not None:
                iv = res.interval
                rows.append((spec.title, iv.median, iv.lo, iv.hi, res.resolved))
        out[t.name] = rows
    return out


def throughput_data(t: Table) -> dict:
    """{workload: [(variant, median, lo, hi, kind)]} of the ok cells."""
    out = {}
    for w in t.workloads:
        rows = []
        for v in t.variants:
            iv = t.tok_s(v, w)
            if iv is not None:
                rows.append((v, iv.median, iv.lo, iv.hi, t.cell(v, w).get("kind", "peer")))
        if rows:
            out[w] = rows
    return out


def digest(data) -> str:
    text = json.dumps({"v": PLOT_VERSION, "data": data}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _png(fig, d: str) -> bytes:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Source-Digest": d})
    plt.close(fig)
    return buf.getvalue()


def plot_ratios(tables: list[Table]) -> bytes:
    """One forest plot: a row per headline ratio, a marker and interval per sweep (hollow and grey
    when unresolved), on a log axis centred on 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator
    data = ratios_data(tables)
    labels = [s.title for s in R.HEADLINE if any(r[0] == s.title for rows in data.values() for r in rows)]
    row = {label: i for i, label in enumerate(labels[::-1])}
    fig, ax = plt.subplots(figsize=(11, 0.34 * max(len(labels), 3) + 1.6))
    n = max(len(data), 1)
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b"]
    values = []
    for i, (name, rows) in enumerate(data.items()):
        color = palette[i % len(palette)]
        dy = (i - (n - 1) / 2) * 0.6 / n
        for label, med, lo, hi, ok in rows:
            y = row[label] + dy
            ax.plot([lo, hi], [y, y], color=color if ok else "#bbbbbb", lw=1.3)
            ax.plot([med], [y], "o", ms=5, color=color if ok else "white", mec=color if ok else "#999999")
            values += [lo, hi]
        ax.plot([], [], "o", color=color, label=name)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    lo, hi = (min(values), max(values)) if values else (0.5, 2.0)
    ticks = [t for t in (0.1, 0.2, 0.25, 0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)
             if lo / 1.3 <= t <= hi * 1.3]
    ax.set_xlim(min(ticks + [lo]) / 1.1, max(ticks + [hi]) * 1.1)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels[::-1], fontsize=8)
    ax.set_xlabel("tok/s ratio, log scale (above 1: the first is faster); hollow grey = unresolved", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Headline ratios: median and 95% interval over interleaved rounds", fontsize=10)
    fig.tight_layout()
    return _png(fig, digest(data))


def plot_throughput(t: Table) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = throughput_data(t)
    n = max(len(data), 1)
    cols = min(4, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 0.45 * max(len(t.variants), 3) * nrows + 1.6),
                             squeeze=False)
    for ax, (w, rws) in zip(axes.flat, data.items()):
        rws = rws[::-1]  # first variant on top
        med = [r[1] for r in rws]
        ys = range(len(rws))
        ax.barh(ys, med, color=[COLORS.get(r[4], "#888") for r in rws])
        ax.errorbar(med, ys, xerr=[[r[1] - r[2] for r in rws], [r[3] - r[1] for r in rws]], fmt="none",
                    ecolor="black", elinewidth=0.8, capsize=2)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r[0] for r in rws], fontsize=7)
        ax.set_title(WORKLOADS[w].title, fontsize=9)
        ax.set_xlabel("tok/s (median; whisker = 95% interval)", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.suptitle(f"Throughput per variant, sweep {t.name} (blue: ours, orange: peers)", fontsize=9)
    fig.tight_layout()
    return _png(fig, digest(data))


def expected(tables: list[Table]) -> dict[str, tuple]:
    """{file name: (digest, render function)} of every plot publish writes."""
    out = {RATIOS_PNG: (digest(ratios_data(tables)), lambda: plot_ratios(tables))}
    for t in tables:
        out[throughput_png(t)] = (digest(throughput_data(t)), lambda t=t: plot_throughput(t))
    return out


def read_digest(path) -> str | None:
    """The Source-Digest text chunk of a PNG, or None when absent/unreadable."""
    try:
        from PIL import Image
        with Image.open(path) as im:
            return im.text.get("Source-Digest")
    except (OSError, ValueError):
        return None
