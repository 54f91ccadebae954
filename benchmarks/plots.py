"""PNG plots of a Table: tok/s per variant (one panel per workload) and capture overhead.

Each PNG carries a `Source-Digest` text chunk (a hash of exactly the figures it draws), so
`publish --check` can tell a stale plot from a fresh one without comparing pixels, which differ
between font and freetype builds."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.stats import sig
from benchmarks.table import Table
from benchmarks.workloads import BY_NAME as WORKLOADS

PLOT_VERSION = 1
THROUGHPUT_PNG = "throughput.png"
OVERHEAD_PNG = "capture_overhead.png"
OVERHEAD_WORKLOADS = ("capture_one", "capture_all", "lens", "capture_gen", "steer")
COLORS = {"ours": "#1f77b4", "peer": "#ff7f0e"}


def throughput_data(t: Table) -> dict:
    out = {}
    for w in t.workloads:
        rows = [(v, t.tok_s(v, w), t.tok_s(v, w, "q1"), t.tok_s(v, w, "q3"), t.cell(v, w).get("kind", "peer"))
                for v in t.variants if t.cell(v, w) and t.tok_s(v, w) is not None]
        if rows:
            out[w] = rows
    return out


def overhead_data(t: Table) -> dict:
    out = {}
    for v in t.variants:
        r = {w: t.vs_own(v, w) for w in OVERHEAD_WORKLOADS if t.vs_own(v, w) is not None}
        if r:
            out[v] = r
    return out


def digest(data, title: str) -> str:
    text = json.dumps({"v": PLOT_VERSION, "title": title, "data": data}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _title(t: Table) -> str:
    e, p = t.env(), t.params()
    return (f"{p.get('model')} ({p.get('source')}), {p.get('dtype')}, {e.get('hardware', '?')}, "
            f"prompt {p.get('prompt_tokens')} / new {p.get('new_tokens')} tokens")


def plot_throughput(t: Table, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data, title = throughput_data(t), _title(t)
    n = max(len(data), 1)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 0.45 * max(len(t.variants), 3) * rows + 1.6),
                             squeeze=False)
    for ax, (w, rws) in zip(axes.flat, data.items()):
        rws = rws[::-1]  # first variant on top
        med = [r[1] for r in rws]
        ys = range(len(rws))
        ax.barh(ys, med, color=[COLORS.get(r[4], "#888") for r in rws])
        ax.errorbar(med, ys, xerr=[[r[1] - r[2] for r in rws], [r[3] - r[1] for r in rws]], fmt="none",
                    ecolor="black", elinewidth=0.8, capsize=2)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{r[0]}  {sig(r[1], 3)}" for r in rws])
        ax.set_title(WORKLOADS[w].title, fontsize=9)
        ax.set_xlabel("tok/s (median; whisker = q1–q3)", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max(med) * 1.5)  # a wild q3 is clipped rather than squashing every bar
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    if not data:
        axes.flat[0].text(0.5, 0.5, "no measured cells", ha="center")
    fig.suptitle(f"Throughput per variant (blue: ours, orange: peers)\n{title}", fontsize=9)
    fig.tight_layout()
    d = digest(data, title)
    fig.savefig(path, dpi=110, metadata={"Source-Digest": d})
    plt.close(fig)
    return d


def plot_overhead(t: Table, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data, title = overhead_data(t), _title(t)
    variants = list(data)
    fig, ax = plt.subplots(figsize=(max(9.0, 1.3 * len(variants) + 2), 5.0))
    width = 0.8 / len(OVERHEAD_WORKLOADS)
    for i, w in enumerate(OVERHEAD_WORKLOADS):
        xs = [j + (i - (len(OVERHEAD_WORKLOADS) - 1) / 2) * width for j, v in enumerate(variants) if w in data[v]]
        ys = [data[v][w] for v in variants if w in data[v]]
        if ys:
            ax.bar(xs, ys, width, label=f"{WORKLOADS[w].title} / {WORKLOADS[w].baseline}")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, fontsize=8)
    ax.set_ylabel("tok/s relative to the same variant's plain run", fontsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.suptitle(f"Cost of capture, steering and lens: tok/s over the same variant's plain run "
                 f"(1.0 = free, below 1 = slower)\n{title}", fontsize=9)
    if not data:
        ax.text(0.5, 0.5, "no measured cells", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    d = digest(data, title)
    fig.savefig(path, dpi=110, metadata={"Source-Digest": d})
    plt.close(fig)
    return d


PLOTS = {THROUGHPUT_PNG: (plot_throughput, throughput_data), OVERHEAD_PNG: (plot_overhead, overhead_data)}


def expected_digest(t: Table, name: str) -> str:
    return digest(PLOTS[name][1](t), _title(t))


def read_digest(path: Path) -> str | None:
    """The Source-Digest text chunk of a PNG, or None when absent/unreadable."""
    try:
        from PIL import Image
        with Image.open(path) as im:
            return im.text.get("Source-Digest")
    except (OSError, ValueError):
        return None
