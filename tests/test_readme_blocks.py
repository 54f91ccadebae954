"""scripts/readme_blocks.py and the README it checks: every fenced block of README.md and docs/ is found, parses,
and is run somewhere (fast here, slow in CI's slow step, by a named test, or skipped with its reason); blocks
carry no placeholder that fails as pasted; the README is short, leads with what the project is, and its table of
contents is its headings; links between the pages resolve; the runner runs a block as a reader would, from a
temporary directory outside the checkout, starts the one server the server blocks need, and says what failed."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import readme_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _headings(text: str, level: str = "## ") -> list[str]:
    prose = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.M | re.S)
    return [line[len(level):].strip() for line in prose.splitlines() if line.startswith(level)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# -- the blocks ------------------------------------------------------------------------------------------------
def test_every_block_is_found_parses_and_says_how_it_is_checked():
    blocks = readme_blocks.all_blocks()  # raises on a duplicate name or an unknown word in a marker
    names = {b.name for b in blocks}
    assert {"quick-start", "sae", "readouts", "workflows", "real-saes", "zoo-list", "server"} <= names
    assert {b.file for b in blocks} >= {README, ROOT / "docs" / "saes.md"}
    for b in blocks:
        if b.python:
            compile(b.code(), b.where, "exec")
        else:
            proc = subprocess.run(["bash", "-n", "-c", b.code()], capture_output=True, text=True)
            assert proc.returncode == 0, f"{b.where}: {proc.stderr}"
    assert [b.name for b in blocks if b.serve] == [readme_blocks.serve_block().name]
    with pytest.raises(ValueError, match="unknown README block 'nope'; blocks: setup, quick-start"):
        readme_blocks.get("nope")


def test_a_block_left_to_a_test_names_one_that_exists():
    for b in readme_blocks.all_blocks():
        if b.by:
            path, name = b.by.split("::")
            tree = ast.parse((ROOT / path).read_text())
            assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, f"{b.where}: {b.by}"
            assert b.name in (ROOT / path).read_text(), f"{b.by} should run {b.name!r} by its name"


def test_no_block_holds_a_placeholder_that_fails_as_pasted():
    """`connect("http://gpu-box:8000")`, `--out .validator/runs/<name>` and `micro [--rows 8]` failed as pasted;
    a value a reader changes is an environment variable with a default that runs. And a block that runs outside
    the checkout uses the activated interpreter, not `.venv/bin/python` or `PYTHONPATH=.`."""
    for b in readme_blocks.all_blocks():
        code = "\n".join(line.split("#", 1)[0] for line in b.code().splitlines())
        assert not re.search(r"<[a-z_ -]+>|gpu-box|\[--[a-z]", code), f"{b.where}: a placeholder"
        if not b.repo:
            assert ".venv/bin/" not in code and "PYTHONPATH=." not in code, f"{b.where}: runs from the checkout only"


def test_the_examples_build_their_tensors_where_the_model_runs():
    """A tensor an example makes for a model (a steer vector, an SAE) is made on m.device (issue 35: the
    quick start's torch.randn(m.d_model) failed against a cuda model)."""
    for b in readme_blocks.all_blocks():
        for line in b.code().splitlines() if b.python and "load_model(" in b.code() else ():
            if re.search(r"torch\.(randn|zeros|ones|rand|tensor)\(", line) and "generator=" not in line:
                assert "m.device" in line, f"{b.where}: {line.strip()}"
            if "load_sae(" in line:
                assert "device=m.device" in line, f"{b.where}: {line.strip()}"


def test_the_quick_start_runs_as_written(capsys):
    ns: dict = {}
    exec(compile(readme_blocks.get("quick-start").code(), "README.md", "exec"), ns)
    m, out = ns["m"], ns["out"]
    assert ns["v"].device == m.device and out.cache["resid_post.1"].shape[-1] == m.d_model
    printed = capsys.readouterr().out
    n = ns["logits"].shape[1]
    assert f"'attn_probs.0': (1, {n}, " in printed and f"torch.Size([1, {n + 5 - 1}, {m.d_model}])" in printed


# -- the README as a page ------------------------------------------------------------------------------------------
def test_the_readme_leads_and_stays_short():
    """What it is, the set-up commands and a short example come before the contents; the reference lives in docs/."""
    text = README.read_text()
    assert len(text.splitlines()) < 400
    heads = _headings(text)
    assert heads[:3] == ["Set up", "A first example", "Contents"]
    intro = text.split("\n## ", 1)[0]
    assert len(intro.split("\n\n")[1].splitlines()) <= 6  # what it is, in five lines or so
    setup = readme_blocks.get("setup").code()
    assert [ln.split("#")[0].strip() for ln in setup.strip().splitlines()] == ["bash scripts/setup.sh",
                                                                                "source .venv/bin/activate"]
    assert len(readme_blocks.get("quick-start").code().strip().splitlines()) <= 12


def test_the_table_of_contents_is_the_readmes_headings():
    text = README.read_text()
    heads = _headings(text)
    toc = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^- \[(.+?)\]\(#([^)]+)\)$", toc, re.M)
    after = heads[heads.index("Contents") + 1:]
    assert [t for t, _ in entries] == after, "README's Contents must list its ## headings, in order"
    assert all(a == anchor(t) for t, a in entries)


def test_every_doc_is_listed_in_the_readme():
    listed = re.findall(r"^- \[docs/([\w.-]+\.md)\]\(docs/\1\)", README.read_text().split("## Reference documentation")[1],
                        re.M)
    assert sorted(listed) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_pages_resolve(page):
    """Every relative link of README.md and docs/*.md names a file that exists and, with #anchor, one of its
    headings (moving sections between pages must not leave a link behind)."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} (no such file)"
        if frag and dest.suffix == ".md":
            anchors = {anchor(h) for lvl in ("# ", "## ", "### ", "#### ") for h in _headings(dest.read_text(), lvl)}
            assert frag in anchors, f"{page.name}: {target} (no such heading in {dest.name})"


# -- the runner ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_pages(tmp_path, monkeypatch):
    """A README and one docs page of the runner's own making, under a fake checkout root."""
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    monkeypatch.setattr(readme_blocks, "ROOT", root)
    monkeypatch.setattr(readme_blocks, "README", root / "README.md")
    monkeypatch.setattr(readme_blocks, "DOCS", root / "docs")
    return root


SERVER = ("python - <<'EOF'\nimport http.server, os\nclass H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n        self.send_response(200); self.end_headers(); self.wfile.write(b'up')\n"
          "http.server.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\nEOF\n")


def test_the_runner_runs_blocks_from_outside_the_checkout_and_says_what_failed(fake_pages, tmp_path, capsys):
    """Python blocks saved as scripts, shell blocks as pasted, both from the work folder; the one serve block
    started on a free port for the blocks that need it (and stopped); skipped and test-run blocks listed with why;
    each failure named with its output; exit 1."""
    (fake_pages / "README.md").write_text(
        "# R\n\n## A\n\n```python\nimport pathlib\npathlib.Path('a.txt').write_text(__file__)\n```\n\n"
        "<!-- block: broken -->\n```bash\necho about to fail\nfalse\necho never\n```\n\n"
        "<!-- block: srv serve slow -->\n```bash\n" + SERVER + "```\n\n"
        "<!-- block: ask slow needs=server -->\n```python\nimport os, urllib.request\n"
        "print('server', urllib.request.urlopen(os.environ['INTERP_URL'] + '/health').read())\n```\n\n"
        "<!-- block: later skip=\"an hour\" -->\n```bash\nsleep 3600\n```\n\n"
        "<!-- block: tested by=tests/test_x.py::test_y -->\n```bash\nexit 1\n```\n\n```\noutput, not run\n```\n")
    (fake_pages / "docs" / "p.md").write_text("# P\n\n## B\n\n```sh\necho docs-ran > marker.txt\n```\n")
    work = tmp_path / "work"
    rc = readme_blocks.main(["--slow", "--workdir", str(work)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "readme readme:a on cpu: ok" in out and "readme broken on cpu: FAILED" in out
    assert "about to fail" in out and "never" not in out
    assert "readme ask on cpu: ok" in out and "readme p:b on cpu: ok" in out and (work / "marker.txt").is_file()
    assert out.rstrip().splitlines()[-1] == ("readme blocks on cpu: 3 of 4 ran; failed: broken; skipped 2: later (an "
                                             "hour); tested (run by tests/test_x.py::test_y)")
    assert (work / "a.txt").read_text() == str(work.resolve() / "readme_a.py")  # saved there and run from there
    rc = readme_blocks.main(["--workdir", str(work)])  # without --slow: the slow blocks are left out
    assert "readme ask" not in capsys.readouterr().out


def test_the_runner_sends_every_load_to_the_device_it_is_given(fake_pages, tmp_path, capsys):
    """On --device cuda (a machine without one here), a block's load_model is sent there: it fails naming cuda."""
    (fake_pages / "README.md").write_text("# R\n\n<!-- block: quick-start -->\n```python\nfrom engine import load_model\n"
                                          "m = load_model('meta-llama/Llama-3.2-1B')\n```\n")
    rc = readme_blocks.main(["--device", "cuda", "--names", "quick-start", "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert rc == 1 and "readme quick-start on cuda: FAILED" in out and "cuda" in out.split("FAILED", 1)[1]
    assert out.rstrip().endswith("0 of 1 ran; failed: quick-start")


def test_a_marker_with_an_unknown_word_is_refused(fake_pages):
    (fake_pages / "README.md").write_text("# R\n\n<!-- block: x slw -->\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match=r"README.md:4: unknown word 'slw' in a block marker"):
        readme_blocks.all_blocks()


def test_the_runner_on_the_cpu_runs_the_quick_start_from_a_temporary_folder():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_blocks.py"), "--names", "quick-start,zoo-list"],
                          capture_output=True, text=True, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "readme quick-start on cpu: ok" in proc.stdout and "2 of 2 ran" in proc.stdout


@pytest.mark.slow
def test_every_block_runs_as_a_reader_would(tmp_path):
    """CI's slow step: every block that is not skipped or left to a named test, the server blocks against the
    README's own server command, from a temporary folder."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_blocks.py"), "--slow", "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=2400, cwd="/")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout.splitlines()[-1]
    assert (tmp_path / "patching.png").stat().st_size > 0  # the workflows block wrote its plot where it ran
