// History: what every published night recorded, as plots: the validator's passing rows and its undeclared
// failures per column, and each sweep's headline ratios with their intervals (reports/*/history/).
import { ratioNights, validatorNights } from "../../visualizer-data/history.generated";
import { frame, h, table, unique } from "./dom";
import { nightChart, type NightSeries } from "./nights";

const main = frame("history.html", "History",
  `${validatorNights.length} published validator run(s) and ${unique(ratioNights.map((r) => r.date)).length} benchmark ` +
  `publication(s), night by night: pass counts per matrix column and the headline ratios with their 95% intervals. ` +
  `A ratio left unresolved that night shows its interval alone, dashed. What changed since the previous night: ` +
  `python -m validator report --since REF, and the benchmark report's "Since the previous publication".`);

const vDates = validatorNights.map((n) => n.date);
const columns = unique(validatorNights.flatMap((n) => Object.keys(n.columns))).sort();
const perColumn = (pick: (c: { pass: number; fail: number; errors: number }) => number): NightSeries[] =>
  columns.map((col) => ({ label: col, points: validatorNights.filter((n) => n.columns[col]).map((n) =>
    ({ date: n.date, value: pick(n.columns[col]) })) }));

const validator = h("section", { id: "validator-history", "aria-labelledby": "h-validator" }, h("h2", { id: "h-validator" }, "Validator"));
if (!validatorNights.length) {
  validator.append(h("p", { class: "muted" }, "No published validator run is recorded yet (reports/validator/history/)."));
} else {
  validator.append(
    h("figure", {}, nightChart(vDates, perColumn((c) => c.pass), "passing rows per column, night by night", "passing rows")),
    h("figure", {}, nightChart(vDates, perColumn((c) => c.fail + c.errors),
      "undeclared failing rows and error cells per column, night by night", "undeclared failures + error cells")));
  const last = validatorNights[validatorNights.length - 1];
  validator.append(table(`Counts of ${last.date} (commit ${last.commit.slice(0, 10)})`, [
    { head: "column", cell: (c: string) => h("code", {}, c) },
    ...(["cells", "pass", "warn", "fail", "declared", "gap", "errors", "skipped"] as const).map((k) =>
      ({ head: k, cls: "num", cell: (c: string) => last.columns[c][k] })),
  ], Object.keys(last.columns).sort(), (c) => c, "validator-latest"));
}

const bench = h("section", { id: "ratio-history", "aria-labelledby": "h-ratios" }, h("h2", { id: "h-ratios" }, "Headline ratios"));
const bDates = unique(ratioNights.map((r) => r.date)).sort();
const sweeps = unique(ratioNights.map((r) => r.sweep)).sort();
if (!sweeps.length) bench.append(h("p", { class: "muted" }, "No benchmark publication is recorded yet (reports/benchmarks/history/)."));
for (const sw of sweeps) {
  const sec = h("div", { class: "ratio-group", "data-sweep": sw }, h("h3", {}, sw));
  for (const g of unique(ratioNights.filter((r) => r.sweep === sw).map((r) => r.group))) {
    const rs = ratioNights.filter((r) => r.sweep === sw && r.group === g);
    const series: NightSeries[] = unique(rs.map((r) => r.key)).map((key) => {
      const mine = rs.filter((r) => r.key === key);
      return { label: mine[0].title, points: mine.map((r) => ({ date: r.date, value: r.median, lo: r.lo, hi: r.hi })) };
    });
    sec.append(h("figure", { "data-group": g }, nightChart(bDates, series, `${sw}, ${g}: headline ratios, night by night`,
      `${g}: ratio (log scale); above 1× is faster`, true)));
  }
  bench.append(sec);
}
main.append(validator, bench);
