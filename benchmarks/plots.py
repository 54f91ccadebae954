"""PNG plots of a Table: tok/s per variant (one panel per workload) and capture overhead.

Each PNG carries a `Source-Digest` text chunk (a hash of exactly the figures it draws), so
`publish --check` can tell a stale plot from a fresh one without comparing pixels, which differ
between font and freetype builds."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
        names = [r[0] for r in rws][::-1]
        med = [r[1] for r in rws][::-1]
        lo = [r[1] - r[2] for r in rws][::-1]
        hi = [r[3] - r[1] for r in rws][::-1]
        ax.barh(names, med, xerr=[lo, hi], color=[COLORS.get(r[4], "#888") for r in rws][::-1], capsize=2)
        for y, m in enumerate(med):
            ax.text(m, y, f" {m:.3g}", va="center", fontsize=7)
        ax.set_title(WORKLOADS[w].title, fontsize=9)
        ax.set_xlabel("tok/s (median, bar = q1–q3)", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max(med) * 1.35)
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
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(variants) + 2), 4.2))
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Cost of capture, steering and lens (1.0 = free)\n{title}", fontsize=9)
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
