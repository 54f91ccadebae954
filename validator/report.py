"""Reports rendered from the cells, never edited: README matrix, per-model details, CSV, heatmap.

Everything here is a pure function of the cell files (and of the zoo's list of names, against which
a matrix is called complete or partial), so `--check` can re-render into memory and compare with
what is committed (the PNG through the digest of its data, stored in its metadata, and it must
decode). Columns are engines, suffixed with the variant tag for cells not computed with the
published configuration (validator/variant.py).
"""
from __future__ import annotations

import io
import math
from collections import Counter, defaultdict
from pathlib import Path

from validator import cells, known_gaps
from validator.engines import ENGINES
from validator.order import point_rank
from validator.scoring import VERDICTS
from validator.variant import label

ORDER = {v: i for i, v in enumerate(("pass", "gap", "warn", "fail"))}  # worse is larger
HEAT_NAME = "heatmap.png"
CSV_NAME = "summary.csv"


def col(cell) -> str:
    """The matrix column of a cell: its engine, plus its variant tag when not the published one."""
    return label(cell["engine"], cell.get("variant_tag", ""))


def _engines(all_cells) -> list[str]:
    """Columns present, registry order first, each engine's variants after it."""
    seen = {col(c) for c in all_cells}
    order = {e: i for i, e in enumerate(ENGINES)}
    return sorted(seen, key=lambda x: (order.get(x.split("@")[0], len(order)), x))


def _counts(cell) -> str:
    if cell is None:
        return "-"
    if cell.get("status") == "skipped":
        return "skipped"
    if cell.get("status") == "error":
        return "ERROR"
    s = cell.get("summary", {})
    return "/".join(str(s.get(v, 0)) for v in VERDICTS)


def _fmt(x) -> str:
    return "" if x is None else f"{x:.1e}"


def _where(row) -> str:
    from validator.rows import where
    return where(row)


def _kid(row) -> str:
    """The declared entry id of a row ("" when none); rows store the id, older cells the whole entry."""
    k = row.get("known")
    return (k.get("id", "") if isinstance(k, dict) else k) or ""


def declared_failures(cell) -> int:
    """Failing rows whose cause is a declared upstream bug (they stay failures in the tables, but do not
    fail the run: the declaration carries the evidence)."""
    return sum(1 for r in cell.get("rows", []) if r["verdict"] == "fail" and r.get("known"))


def cell_failed(cell) -> bool:
    """An error cell, or a failing row that no declared cause explains."""
    return cell.get("status") == "error" or cell.get("summary", {}).get("fail", 0) > declared_failures(cell)


def _structural_kind(row) -> str:
    """'shape mismatch', 'padding leak', ... of a structural failure ('' for a numeric one)."""
    first = (row.get("structural") or [""])[0]
    return first.split(":")[0].split(" (")[0].strip()[:40]


# -- README -----------------------------------------------------------------------------------------
def zoo_names() -> list[str]:
    from engine.zoo import ZOO
    return list(ZOO)


def _commit_of(all_cells, engine: str, digest: str) -> str:
    """The commit most of `engine`'s cells computed by code `digest` record (short)."""
    commits = Counter(c.get("provenance", {}).get("commit", "?") for c in all_cells
                      if col(c) == engine and c.get("provenance", {}).get("code_digest", "?") == digest)
    return commits.most_common(1)[0][0][:8]


def coverage(all_cells, zoo: list[str]) -> list[str]:
    """Lines saying where the matrix is partial (empty when every column covers the zoo with cells of one
    version of the code): missing models, ad-hoc variants, and columns whose cells different code computed."""
    out = []
    for e in _engines(all_cells):
        have = {c["model"] for c in all_cells if col(c) == e}
        if "@" in e:
            out.append(f"- `{e}`: an ad-hoc variant ({e.split('@', 1)[1].replace('+', ', ')}), not the published "
                       f"configuration; {len(have)} models.")
            continue
        missing = [m for m in zoo if m not in have]
        if missing:
            out.append(f"- `{e}`: {len(have & set(zoo))} of {len(zoo)} zoo models; missing "
                       f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}.")
        versions = Counter(c["provenance"]["code_digest"] for c in all_cells  # skipped cells ran no code
                           if col(c) == e and c.get("provenance", {}).get("code_digest"))
        if len(versions) > 1:
            out.append(f"- `{e}`: cells from {len(versions)} versions of the code: " + "; ".join(
                f"{n} computed by code {d} (at {_commit_of(all_cells, e, d)})" for d, n in versions.most_common())
                + f". A run on the current code recomputes the stale ones (`python -m validator run --engines "
                  f"{e.split('@')[0]}`; `--check` lists them).")
    gone = sorted({c["model"] for c in all_cells} - set(zoo))
    if gone:
        out.append(f"- cells of models no longer in the zoo: {', '.join(gone[:6])}{' ...' if len(gone) > 6 else ''}.")
    return out


def render_readme(all_cells, zoo: list[str] | None = None, selftest: dict | None = None) -> str:
    zoo = zoo_names() if zoo is None else zoo
    engines = _engines(all_cells)
    by = {(c["model"], col(c)): c for c in all_cells}
    models = sorted({c["model"] for c in all_cells})
    fam = {c["model"]: c.get("family", "?") for c in all_cells if c.get("family")}
    points = sorted({r["point"] for c in all_cells for r in c.get("rows", [])} - {"steer", "decode"})
    partial = coverage(all_cells, zoo)
    lines = ["# Validator results", "",
             "Generated by `python -m validator run` (re-render: `python -m validator report`; "
             "check: `python -m validator report --check`). Do not edit.", "",
             "Each entry counts rows as pass/warn/fail/gap. The engine is validated as `load_model` gives it "
             "(default attention: sdpa for most families), each reference running the same attention "
             "implementation; TransformerLens, which computes attention itself, against the engine with "
             "`attention=\"eager\"`; the hf column also checks the attention patterns of that eager "
             "configuration. What the rows check, by kind, is in the table below. Rows computed with the same "
             "kernels on both sides must be bit-exact; the others pass within their tier, the measured noise "
             "floor (`validator/tolerances.py`). Declared gaps, known bugs and measured inexactness: "
             "`validator/known_gaps.py`. `declared` counts failing rows whose upstream cause is declared with "
             "evidence (they stay failures here, but do not fail the run).", "",
             f"**{len(models)} models, {len(points)} points, {len(all_cells)} cells; "
             + ("partial matrix:**" if partial else f"every column covers all {len(zoo)} zoo models.**"), ""]
    if partial:
        lines += partial + [""]
    lines += ["| engine | compares | pass | warn | fail | declared | gap | cells with an undeclared failure |",
              "|---|---|---|---|---|---|---|---|"]
    for e in engines:
        cs = [c for c in all_cells if col(c) == e]
        tot = defaultdict(int)
        for c in cs:
            for v, n in c.get("summary", {}).items():
                tot[v] += n
        known = sum(declared_failures(c) for c in cs)
        base = e.split("@")[0]
        what = ENGINES[base].what if base in ENGINES else ""
        skipped = sum(c.get("status") == "skipped" for c in cs)
        lines.append(f"| {e} | {what} | {tot['pass']} | {tot['warn']} | {tot['fail'] - known} | {known} | "
                     f"{tot['gap']} | {sum(cell_failed(c) for c in cs)} of {len(cs)}"
                     f"{f' ({skipped} skipped)' if skipped else ''} |")
    lines += [""] + _kinds_table(all_cells, engines) + [""] + _selftest_lines(selftest)
    lines += ["", "## Matrix (pass/warn/fail/gap)", "", "| model | family | " + " | ".join(engines) + " |",
              "|---|---|" + "---|" * len(engines)]
    for mdl in models:
        link = f"[{mdl}](details/{cells.slug(mdl)}.md)"
        lines.append(f"| {link} | {fam.get(mdl, '?')} | " + " | ".join(_counts(by.get((mdl, e))) for e in engines) + " |")
    lines += ["", "## Failures", ""] + _failures(all_cells)
    from validator.dropin import render_dropin
    lines += render_dropin(all_cells)
    lines += ["", "## Declared gaps and known bugs in use", "", "| id | kind | rows | reason | evidence |",
              "|---|---|---|---|---|"]
    used = defaultdict(int)
    for c in all_cells:
        for r in c.get("rows", []):
            if r.get("known"):
                used[_kid(r)] += 1
    for k in known_gaps.KNOWN:
        if used.get(k.id):
            lines.append(f"| {k.id} | {k.kind} | {used[k.id]} | {k.reason} | {k.evidence} |")
    stale = sorted({(c["model"], c["engine"], r["stale_known"]) for c in all_cells for r in c.get("rows", [])
                    if r.get("stale_known")})
    if stale:
        lines += ["", "Declared bugs or definitions that did not reproduce (remove them?): " +
                  ", ".join(f"{k} ({m} / {e})" for m, e, k in stale)]
    skipped = defaultdict(list)
    for c in all_cells:
        if c.get("status") == "skipped":
            skipped[(col(c), c.get("reason", ""))].append(c["model"])
    if skipped:
        lines += ["", "## Skipped engines", ""] + [
            f"- {e} ({len(ms)} models: {', '.join(m.split('/')[-1] for m in sorted(ms))}): {why}"
            for (e, why), ms in sorted(skipped.items())]
    lines += ["", f"Heatmap of the worst relative error by family x point: [{HEAT_NAME}]({HEAT_NAME}); all rows: "
              f"[{CSV_NAME}]({CSV_NAME}).", ""]
    return "\n".join(lines)


KINDS = (("short, long, padded", ("short", "long", "padded"),
          "every point at its validated layers: a short prompt, one longer than the sliding window, a left-padded "
          "batch (real tokens only)"),
         ("leak", ("leak",), "the engine's padded short row against its own prompt alone (hf and vLLM columns)"),
         ("decode", ("decode",), "every position of a greedy generation's captures against the reference recomputing "
                                 "HF's own generated tokens"),
         ("address", ("address",), "other forms of an address (negative layer, a head coordinate written both ways, "
                                   "aliases) against the reference's absolute one"),
         ("steer", ("steer",), "logits after every op of the op table at several position specs, on resid_post and "
                               "an attention-internal point, against the validator's own maths in the reference's "
                               "hook"),
         ("lens", ("lens",), "the logit lens at every validated resid_post layer against the reference's own final "
                             "norm and head"),
         ("readout", ("readout",), "every readout kind against the same reduction of the reference's tensor"),
         ("generate", ("generate", "steer_generate"), "greedy tokens and their scores against HF's own generate, "
                                                      "plain and steered at each position spec"))


def _kinds_table(all_cells, engines: list[str]) -> list[str]:
    """Rows per kind of check and column: what each new kind adds to the matrix."""
    count = defaultdict(int)
    for c in all_cells:
        for r in c.get("rows", []):
            count[(col(c), r["case"])] += 1
    out = ["## What the rows check", "", "| kind | what | " + " | ".join(engines) + " |",
           "|---|---|" + "---|" * len(engines)]
    for name, cases, what in KINDS:
        out.append(f"| {name} | {what} | " + " | ".join(str(sum(count[(e, k)] for k in cases)) for e in engines) + " |")
    return out


def _selftest_lines(data: dict | None) -> list[str]:
    """What a pass is worth: the mutation self-test's published score (validator/selftest.py)."""
    if not data:
        return ["## What a pass is worth", "", "The mutation self-test has not been published "
                "(`python -m validator selftest`)."]
    cats = defaultdict(lambda: [0, 0])
    for o in data.get("outcomes", []):
        cats[o["category"]][0] += bool(o["failed"] and o["named"])
        cats[o["category"]][1] += 1
    lines = ["## What a pass is worth", "",
             f"`python -m validator selftest` seeds {data['total']} realistic engine bugs one at a time (in process: "
             f"`validator/mutations.py`) and checks that the run fails with a row naming the point each bug breaks: "
             f"**{data['caught']} of {data['total']} caught** (at {data.get('commit', '?')[:7]})."
             + (f" Missed: {', '.join(data['missed'])}." if data.get("missed") else ""), "",
             "| category | seeded bugs (on each model they apply to) | caught |", "|---|---|---|"]
    lines += [f"| {c} | {n} | {k} |" for c, (k, n) in sorted(cats.items())]
    return lines


def _failures(all_cells, per_model: int = 6) -> list[str]:
    """Undeclared failures (they fail the run) row by row, then failures with a declared upstream cause
    grouped per model and cause. A model that did not load is listed once, and each failing row once
    with the columns it failed in (the engine side is shared, so one defect fails every column)."""
    out = ["Undeclared (these fail the run):", ""]
    load = {}
    for c in all_cells:
        if c.get("status") == "error":
            load.setdefault(c["model"], (c.get("error") or "").split(" Supported:")[0][:240])
    for mdl, err in sorted(load.items()):
        out.append(f"- **{mdl}**: ERROR: {err}")
    groups, declared = defaultdict(list), defaultdict(lambda: [set(), set(), 0])
    for c in all_cells:
        for r in c.get("rows", []):
            if r["verdict"] != "fail":
                continue
            if r.get("known"):
                d = declared[(c["model"], _kid(r))]
                d[0].add(_where(r))
                d[1].add(col(c))
                d[2] += 1
                continue
            why = "; ".join(r.get("structural", [])) or r.get("reason") or f"relative error {_fmt(r.get('rel_err'))}"
            groups[(c["model"], r["case"], _where(r), why[:240])].append(col(c))
    by_model = defaultdict(list)
    for (mdl, case, where, why), engines in sorted(groups.items()):
        by_model[mdl].append(f"- {mdl} / {case} / {where} ({', '.join(engines)}): {why}")
    for mdl, items in sorted(by_model.items()):
        out += items[:per_model]
        if len(items) > per_model:
            out.append(f"- {mdl}: {len(items) - per_model} more failing rows in "
                       f"[its details](details/{cells.slug(mdl)}.md)")
    if len(out) == 2:
        out.append("None.")
    if declared:
        out += ["", "With a declared upstream cause (they stay failures, with the cause's evidence; they do not "
                    "fail the run):", ""]
        for (mdl, kid), (where, cols, n) in sorted(declared.items()):
            pts = sorted(where, key=lambda w: (point_rank(w.split(".")[0]), w))
            out.append(f"- {mdl}: {n} rows in {', '.join(sorted(cols))} ({', '.join(pts[:8])}"
                       f"{' ...' if len(pts) > 8 else ''}): `{kid}`, see below and "
                       f"[its details](details/{cells.slug(mdl)}.md)")
    return out


# -- details ----------------------------------------------------------------------------------------
def render_details(model: str, all_cells) -> str:
    mine = [c for c in all_cells if c["model"] == model]
    engines = _engines(mine)
    head = next((c for c in mine if c.get("family")), mine[0] if mine else {})
    lines = [f"# {model}", "", f"Family `{head.get('family', '?')}`, model_type `{head.get('model_type', '?')}`, "
             f"{head.get('n_layers', '?')} layers, source `{head.get('source', '?')}`. Generated from the cells; "
             f"do not edit.", "", "Prompt cases (batch, tokens): " +
             ", ".join(f"{k} {v}" for k, v in sorted(head.get("cases", {}).items())), "",
             "Worst verdict over the cases, and the worst relative error among the compared rows, per point, "
             "layer and engine; a structural failure (shape, mask, padding leak, NaN, all-zero) shows its kind "
             "instead of a figure (see the engine's section).", "",
             "| point | layer | " + " | ".join(engines) + " |", "|---|---|" + "---|" * len(engines)]
    table = defaultdict(dict)
    for c in mine:
        for r in c.get("rows", []):
            key = (r["point"], -1 if r.get("layer") is None else r["layer"])
            cur = table[key].get(col(c))
            err = r.get("rel_err") if r.get("rel_err") is not None else None
            kind = (r.get("mismatch") or _structural_kind(r)) if r["verdict"] == "fail" else ""
            if cur is None:
                table[key][col(c)] = [r["verdict"], err, kind]
            else:
                if ORDER[r["verdict"]] > ORDER[cur[0]]:
                    cur[0] = r["verdict"]
                if err is not None and (cur[1] is None or err > cur[1]):
                    cur[1] = err
                cur[2] = cur[2] or kind
    for (point, layer), per in sorted(table.items(), key=lambda kv: (point_rank(kv[0][0]), kv[0][1])):
        vals = []
        for e in engines:
            v = per.get(e)
            if v is None:
                vals.append("")
            elif v[0] == "fail" and v[2]:
                vals.append(f"fail ({v[2]})")
            else:
                vals.append(f"{v[0]} {_fmt(v[1])}".strip())
        lines.append(f"| {point} | {'' if layer < 0 else layer} | " + " | ".join(vals) + " |")
    for c in mine:
        lines += ["", f"## {col(c)}", ""]
        if c.get("status") != "ok":
            lines.append(f"Status **{c.get('status')}**: {c.get('error') or c.get('reason', '')}")
            continue
        prov = c.get("provenance", {})
        lines.append(f"Rows {_counts(c)} (pass/warn/fail/gap). Reference versions: "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(c.get('reference_versions', {}).items())) or '-'}; "
                     f"dtype {prov.get('dtype')}, device {prov.get('device')}.")
        if c.get("unavailable"):
            who = "The tested backend did not load" if str(c.get("engine", "")).startswith("vllm") else \
                "The reference could not run this model"
            lines.append(f"\n{who}: {c['unavailable']}")
        for note in c.get("notes", []):
            lines.append(f"\nNote: {note}")
        odd = [r for r in c.get("rows", []) if r["verdict"] in ("fail", "warn")]
        if odd:
            lines += ["", "| case | point | verdict | rel err | worst token | why |", "|---|---|---|---|---|---|"]
            for r in odd:
                why = "; ".join(r.get("structural", [])) or r.get("reason", "")
                if r.get("known"):
                    why = f"[{_kid(r)}] {why}".strip()
                lines.append(f"| {r['case']} | {_where(r)} | {r['verdict']} | {_fmt(r.get('rel_err'))} | "
                             f"{r.get('worst_token', '')} | {why[:240].replace('|', '/')} |")
        gaps = defaultdict(list)
        for r in c.get("rows", []):
            if r["verdict"] == "gap":
                gaps[(_kid(r) or "?", r.get("reason", ""))].append(_where(r))
        if gaps:
            lines += ["", "Gaps (declared in validator/known_gaps.py; the runtime reason is the evidence):", ""]
            for (kid, why), where in sorted(gaps.items()):
                pts = sorted(set(where), key=lambda w: (point_rank(w.split(".")[0]), w))
                lines.append(f"- [{kid}] {', '.join(pts)} ({len(where)} rows): {why[:240]}")
        if c.get("tensors"):
            lines += ["", "Which tensor this engine compares:", ""]
            lines += [f"- `{p}`: {t}" for p, t in sorted(c["tensors"].items())]
    return "\n".join(lines) + "\n"


# -- CSV and heatmap --------------------------------------------------------------------------------
def frame(all_cells):
    """Every row of every cell as a DataFrame (the heatmap's input)."""
    import pandas as pd
    recs = []
    for c in all_cells:
        for r in c.get("rows", []):
            recs.append({"model": c["model"], "family": c.get("family"), "engine": col(c), "case": r["case"],
                         "point": r["point"], "layer": r.get("layer"), "verdict": r["verdict"],
                         "rel_err": r.get("rel_err"), "token_rel_err": r.get("token_rel_err"),
                         "cosine": r.get("cosine"), "max_abs": r.get("max_abs"), "known": _kid(r)})
    cols = ["model", "family", "engine", "case", "point", "layer", "verdict", "rel_err", "token_rel_err", "cosine",
            "max_abs", "known"]
    df = pd.DataFrame(recs, columns=cols)
    df["layer"] = df["layer"].astype("Int64")
    return df


def summary(all_cells):
    """One line per model x engine x point x layer over the cases: verdict counts, worst metrics, why."""
    df = frame(all_cells)
    if df.empty:
        return df
    df["worst"] = df["verdict"].map(ORDER)
    keys = ["model", "family", "engine", "point", "layer"]
    g = df.groupby(keys, dropna=False, sort=True)
    out = g.agg(verdict=("worst", "max"), rel_err=("rel_err", "max"), token_rel_err=("token_rel_err", "max"),
                cosine=("cosine", "min"), max_abs=("max_abs", "max"),
                known=("known", lambda k: " ".join(sorted({x for x in k if x}))))
    out["verdict"] = out["verdict"].map({i: v for v, i in ORDER.items()})
    counts = g["verdict"].value_counts().unstack(fill_value=0)
    for v in VERDICTS:
        out[f"n_{v}"] = counts[v].reindex(out.index).fillna(0).astype(int) if v in counts else 0
    return out.reset_index()


def render_csv(all_cells) -> str:
    buf = io.StringIO()
    summary(all_cells).to_csv(buf, index=False, float_format="%.4g", lineterminator="\n")
    return buf.getvalue()


def heat_data(all_cells):
    """{(family, point): worst relative error} over models, layers, cases and engines (compared rows)."""
    df = frame(all_cells)
    df = df[df["rel_err"].notna() & df["family"].notna()]
    if df.empty:
        return {}, [], []
    worst = df.groupby(["family", "point"])["rel_err"].max()
    fams = sorted(df["family"].unique())
    pts = sorted(df["point"].unique(), key=point_rank)
    return {k: float(v) for k, v in worst.items()}, fams, pts


def render_heatmap(all_cells) -> tuple[bytes, str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    data, fams, pts = heat_data(all_cells)
    digest = heat_digest(data)
    grid = np.full((max(len(fams), 1), max(len(pts), 1)), np.nan)
    for (f, p), v in data.items():
        grid[fams.index(f), pts.index(p)] = math.log10(max(v, 1e-12))
    fig, ax = plt.subplots(figsize=(1.0 + 0.38 * max(len(pts), 1), 1.2 + 0.3 * max(len(fams), 1)), dpi=100)
    im = ax.imshow(grid, cmap="viridis", vmin=-12, vmax=0, aspect="auto")
    ax.set_xticks(range(len(pts)), pts, rotation=70, ha="right", fontsize=8)
    ax.set_yticks(range(len(fams)), fams, fontsize=8)
    for (f, p), v in data.items():
        if v > 1e-3:
            ax.text(pts.index(p), fams.index(f), "!", ha="center", va="center", color="red", fontsize=9,
                    fontweight="bold")
    ax.set_title("worst relative error vs references, log10 (blank: no comparison; ! > 1e-3)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01)
    import warnings
    with warnings.catch_warnings():  # a one-family matrix cannot fit its margins; the image is still right
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None, "Description": f"data-digest:{digest}"})
    plt.close(fig)
    return buf.getvalue(), digest


def heat_digest(data: dict) -> str:
    return cells.sha(sorted((k, f"{v:.3g}") for k, v in data.items()))


def png_problem(path: Path) -> str:
    """'' when `path` is a PNG that decodes completely, else what is wrong with it."""
    try:
        from PIL import Image
        with Image.open(path) as im:
            if im.format != "PNG":
                return f"not a PNG ({im.format})"
            im.load()
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # noqa: BLE001  (PIL raises many types for damaged files)
        return f"does not decode ({type(e).__name__}: {e})"
    return ""


def png_digest(path: Path) -> str | None:
    try:
        from PIL import Image
        with Image.open(path) as im:
            desc = im.info.get("Description", "")
    except (OSError, ImportError):
        return None
    return desc.split("data-digest:", 1)[1] if "data-digest:" in desc else None


# -- render / check -----------------------------------------------------------------------------------
def texts(all_cells, out: Path | None = None) -> dict[str, str]:
    """{relative path: content} of every text report (the README reads `out`'s selftest.json, if any)."""
    from validator import selftest
    found = selftest.read(Path(out) / selftest.RESULT.name) if out is not None else None
    out = {"README.md": render_readme(all_cells, selftest=found), CSV_NAME: render_csv(all_cells)}
    for mdl in sorted({c["model"] for c in all_cells}):
        out[f"details/{cells.slug(mdl)}.md"] = render_details(mdl, all_cells)
    return out


def render(out: Path) -> list[Path]:
    """Write every report under `out` from its cells; remove details of models without cells."""
    from engine.core.files import write_atomic  # deferred: `validator --help` imports neither engine nor torch
    out = Path(out)
    all_cells = cells.load_all(out)
    written = []
    wanted = texts(all_cells, out)
    for rel, text in wanted.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists() or p.read_text() != text:
            write_atomic(p, text, mode=0o644)
        written.append(p)
    for stale in (out / "details").glob("*.md"):
        if f"details/{stale.name}" not in wanted:
            stale.unlink()
    png, digest = render_heatmap(all_cells)
    if png_digest(out / HEAT_NAME) != digest or png_problem(out / HEAT_NAME):
        write_atomic(out / HEAT_NAME, png, mode=0o644)
    written.append(out / HEAT_NAME)
    return written


def check(out: Path) -> list[str]:
    """Drift between the reports on disk and what the cells render to (empty = in sync)."""
    out = Path(out)
    all_cells = cells.load_all(out)
    problems = []
    wanted = texts(all_cells, out)
    for rel, text in wanted.items():
        p = out / rel
        if not p.exists():
            problems.append(f"{rel}: missing")
        elif p.read_text() != text:
            problems.append(f"{rel}: differs from what the cells render")
    for stale in (out / "details").glob("*.md"):
        if f"details/{stale.name}" not in wanted:
            problems.append(f"details/{stale.name}: no cell for this model")
    bad_png = png_problem(out / HEAT_NAME)
    if bad_png:
        problems.append(f"{HEAT_NAME}: {bad_png}")
    elif png_digest(out / HEAT_NAME) != heat_digest(heat_data(all_cells)[0]):
        problems.append(f"{HEAT_NAME}: its data digest differs from the cells")
    return problems
