// Builds dist/ from src/ (one bundle per page, each in the same HTML shell) and static/ (CSS): plain files that open from
// file:// (classic scripts, no module loading, no network). `--check` builds in memory and fails
// (exit 1) when dist/ differs, naming each file; `--out DIR` builds (or checks) DIR instead of dist/.
// The data comes only from ../visualizer-data.
import * as esbuild from "esbuild";
import { mkdirSync, readFileSync, readdirSync, existsSync, writeFileSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const outAt = args.indexOf("--out");
if (outAt >= 0 && !args[outAt + 1]) throw new Error("--out needs a directory, e.g. --out /tmp/site");
const dist = outAt >= 0 ? resolve(args[outAt + 1]) : join(root, "dist");
const shown = outAt >= 0 ? dist : "visualizer-web/dist";
const check = args.includes("--check");
const PAGES = ["index", "points", "validation", "speed", "dropin", "history"];

const result = await esbuild.build({
  entryPoints: Object.fromEntries(PAGES.map((p) => [p, join(root, "src", `page-${p}.ts`)])),
  bundle: true,
  format: "iife",
  target: "es2020",
  outdir: dist,
  write: false,
  legalComments: "none",
  minify: true,
  charset: "utf8",
  logLevel: "warning",
});

const files = new Map();
for (const f of result.outputFiles) files.set(f.path.slice(dist.length + 1), Buffer.from(f.contents));
for (const name of readdirSync(join(root, "static")).sort()) files.set(name, readFileSync(join(root, "static", name)));
// every page is the same shell around its bundle (drawn by the script from the data)
const shell = (page) => `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>interp-standard</title>
<link rel="stylesheet" href="style.css">
</head>
<body>
<noscript>These pages are drawn by JavaScript from the generated data; please enable it.</noscript>
<script src="${page}.js"></script>
</body>
</html>
`;
for (const page of PAGES) files.set(`${page}.html`, Buffer.from(shell(page)));

if (check) {
  const drift = [];
  for (const [name, bytes] of files) {
    const path = join(dist, name);
    if (!existsSync(path) || !readFileSync(path).equals(bytes)) drift.push(name);
  }
  const extra = existsSync(dist) ? readdirSync(dist).filter((n) => !files.has(n)) : [];
  for (const n of drift) console.log(`drift: ${shown}/${n} differs from what src/, static/ and visualizer-data build`);
  for (const n of extra) console.log(`drift: ${shown}/${n} is not built by anything (stale)`);
  if (drift.length || extra.length) {
    console.log("regenerate with `npm run build --prefix visualizer-web`");
    process.exit(1);
  }
  console.log(`${files.size} site file(s) match their sources`);
} else {
  if (existsSync(dist) && outAt >= 0 && readdirSync(dist).some((n) => !files.has(n))) {
    throw new Error(`--out ${dist} holds files this build does not write; give an empty or a site directory`);
  }
  rmSync(dist, { recursive: true, force: true });
  mkdirSync(dist, { recursive: true });
  for (const [name, bytes] of files) writeFileSync(join(dist, name), bytes);
  console.log(`wrote ${files.size} files to ${shown}/ (open ${shown}/index.html)`);
}
