"""Every fenced block of README.md and docs/*.md, checked as a reader would use it: a Python block saved as a
script and run from a temporary directory outside the checkout, a shell block pasted into bash there (with
.venv activated, as the README's set-up leaves it).

    python scripts/readme_blocks.py                 # the blocks that run in a test's time (the default tests)
    python scripts/readme_blocks.py --slow          # and the slow ones (CI's slow step), a server started for
                                                    # the blocks that need one
    python scripts/readme_blocks.py --list          # every block: name, where, how it is checked
    python scripts/readme_blocks.py --device cuda [--names quick-start,sae]   # on a GPU (benchmarks/device.sh)

How a block is checked is said by an HTML comment on the line above its fence (nothing: a fast block):

    <!-- block: NAME slow needs=vllm,server repo serve by=tests/FILE.py::TEST skip="why" -->

NAME names it (else FILE:SECTION-N); `slow`: only with --slow; `needs=`: vllm, cuda, server, npm (a block
whose need is missing here is listed as skipped, with the reason); `serve`: it starts the server the `server`
blocks talk to (run in the background on a free port, `$PORT`, `$INTERP_URL`, until they are done); `repo`: it
runs from the checkout's root (it works on the repository); `by=`: a test runs it (with `execute` below) and checks
what it printed, so a sweep leaves it to that test; `skip="why"`: never run (an hour-long publish), with why.
Blocks without a language, or in another one, are output or listings and are not run.

On `--device D` every `load_model(...)` a Python block makes defaults to D. Each block runs in its own process,
so one failure costs one line; the exit status is 1 when any failed. Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose README and docs are checked
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUN = ("python", "bash", "sh", "shell")  # the languages that are run; any other block is output or a listing
NEEDS = ("vllm", "cuda", "server", "npm")
_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*block:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    name: str
    file: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    section: str  # the heading it sits under
    slow: bool = False
    needs: tuple[str, ...] = ()
    serve: bool = False
    repo: bool = False
    skip: str = ""  # why it is never run
    by: str = ""  # the test that runs it (tests/FILE.py::TEST)

    def code(self) -> str:
        """The block's text, as the file has it."""
        return self.text

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file}:{self.line}"

    @property
    def python(self) -> bool:
        return self.lang == "python"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "top"


def parse_marker(text: str, where: str) -> dict:
    """The fields of a `<!-- block: ... -->` comment; ValueError naming an unknown word."""
    out: dict = {"name": "", "slow": False, "needs": (), "serve": False, "repo": False, "skip": "", "by": ""}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        if word in ("slow", "serve", "repo"):
            out[word] = True
        elif key == "needs":
            needs = tuple(n for n in value.split(",") if n)
            bad = [n for n in needs if n not in NEEDS]
            if bad:
                raise ValueError(f"{where}: unknown need {bad[0]!r} (needs: {', '.join(NEEDS)})")
            out["needs"] = needs
        elif key == "by" and re.fullmatch(r"tests/\w+\.py::\w+", value):
            out["by"] = value
        elif key == "skip":
            if not value.strip():
                raise ValueError(f'{where}: skip needs its reason (skip="why")')
            out["skip"] = value.strip()
        elif "=" not in word and not out["name"]:
            out["name"] = word
        else:
            raise ValueError(f"{where}: unknown word {word!r} in a block marker (name, slow, serve, repo, "
                             f"needs=..., by=tests/FILE.py::TEST, skip=\"why\")")
    return out


def blocks_of(path: Path) -> list[Block]:
    """The runnable blocks of one Markdown file, in order."""
    text = path.read_text()
    out: list[Block] = []
    counts: dict[str, int] = {}
    fences = list(_FENCE.finditer(text))
    for m in fences:
        lang = m.group(1).lower()
        if lang not in RUN:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        above = _FENCE.sub("", text[:m.start()])  # headings outside fences (a shell comment is not one)
        heads = re.findall(r"^#{1,6} (.+)$", above, re.M)
        section = heads[-1].strip() if heads else path.stem
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        mark = _MARK.search(before)
        fields = parse_marker(mark.group(1), f"{rel}:{line}") if mark else parse_marker("", "")
        if not fields["name"]:
            base = f"{path.stem.lower()}:{_slug(section)}"
            counts[base] = counts.get(base, 0) + 1
            fields["name"] = base if counts[base] == 1 else f"{base}-{counts[base]}"
        out.append(Block(file=path, line=line, lang="bash" if lang in ("sh", "shell") else lang,
                         text=m.group(2), section=section, **fields))
    return out


def all_blocks() -> list[Block]:
    """Every runnable block of README.md and docs/*.md; ValueError when two share a name."""
    found = blocks_of(README) + [b for p in sorted(DOCS.glob("*.md")) for b in blocks_of(p)]
    seen: dict[str, Block] = {}
    for b in found:
        if b.name in seen:
            raise ValueError(f"two blocks are named {b.name!r} ({seen[b.name].where}, {b.where}); name one in its "
                             f"<!-- block: NAME --> marker")
        seen[b.name] = b
    return found


def get(name: str) -> Block:
    found = {b.name: b for b in all_blocks()}
    if name not in found:
        raise ValueError(f"unknown README block {name!r}; blocks: {', '.join(found)}.")
    return found[name]


# -- what this machine has ---------------------------------------------------------------------------------
def _missing(need: str, python: str) -> str | None:
    """Why `need` is missing here, or None."""
    if need == "npm":
        return None if _which("npm") else "npm is not installed"
    if need == "server":
        return None  # the runner starts one (its file's `serve` block)
    probe = {"vllm": "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)",
             "cuda": "import sys, torch; sys.exit(not torch.cuda.is_available())"}[need]
    ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    return None if ok else ("vLLM is not installed" if need == "vllm" else "no CUDA device")


def _which(cmd: str) -> bool:
    return any(os.access(Path(d) / cmd, os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def environment(python: str, work: Path) -> tuple[dict[str, str], str]:
    """The blocks' environment, as the README's set-up leaves a shell: the interpreter's folder first on PATH
    (an activated .venv). `engine` must import from this checkout there (scripts/setup.sh installs it); where it
    does not (another checkout's shared venv, a device machine), PYTHONPATH points at the checkout and the note
    says so."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}
    if (Path(python).parent.parent / "pyvenv.cfg").is_file():
        env["VIRTUAL_ENV"] = str(Path(python).parent.parent)
    probe = "import importlib.util; s = importlib.util.find_spec('engine'); print(s.origin if s else '')"
    origin = subprocess.run([python, "-c", probe], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120).stdout.strip()
    if origin and Path(origin).resolve().parent == (ROOT / "engine").resolve():
        return env, ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    where = f"imports from {Path(origin).parent}" if origin else "is not installed"
    return env, (f"note: engine {where} for {python}, not from this checkout (bash scripts/setup.sh installs it); "
                 f"PYTHONPATH={ROOT} for these blocks")


# what runs before a Python block on another device: load_model's device defaults to it
_PRELUDE = """import engine as _e, engine.loading as _l
_load = _l.load_model
def _on_device(name, *args, **kw):
    kw.setdefault("device", {device!r})
    return _load(name, *args, **kw)
_e.load_model = _l.load_model = _on_device
"""


def execute(block: Block, device: str, work: Path, env: dict[str, str], python: str = sys.executable,
            timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run one block in its own process from `work` (the checkout's root for a `repo` block): a Python block saved
    as a script there, a shell block pasted into bash. Raises subprocess.TimeoutExpired."""
    cwd = ROOT if block.repo else work
    if block.python:
        script = work / f"{re.sub(r'[^A-Za-z0-9_]', '_', block.name)}.py"
        prelude = "" if device == "cpu" else _PRELUDE.format(device=device)
        script.write_text(prelude + block.text)
        cmd = [python, str(script)]
    else:
        cmd = ["bash", "-eo", "pipefail", "-c", block.text]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def run(block: Block, device: str, work: Path, env: dict[str, str], python: str = sys.executable,
        timeout_s: float = 600) -> tuple[bool, str]:
    """execute(), then (passed, the tail of what it printed)."""
    try:
        proc = execute(block, device, work, env, python, timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"no result within {timeout_s:.0f} s"
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, "\n".join(out[-15:])


class Server:
    """A file's `serve` block run in the background on a free port until its `server` blocks are done."""

    def __init__(self, block: Block, work: Path, env: dict[str, str], timeout_s: float = 600):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "PORT": str(self.port), "INTERP_URL": self.url}
        self.log = work / f"{block.name.replace(':', '_')}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", block.text], cwd=work, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        self.stop()
        raise RuntimeError(f"the server of {block.name} did not answer /health at {self.url}:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def serve_block() -> Block:
    """The one block marked `serve`: the server the `server` blocks talk to."""
    found = [b for b in all_blocks() if b.serve]
    if len(found) != 1:
        raise LookupError(f"the blocks that need a server need exactly one block marked serve; found {len(found)}")
    return found[0]


def check(chosen: list[Block], device: str, work: Path, python: str, say=print,
          run_by_tests: bool = False) -> tuple[int, list[str], list[str]]:
    """Run `chosen` (the serve block started once for the `server` blocks); (ran, failed names, skipped lines).
    A block a test runs (`by=`) is left to it unless `run_by_tests` (or it was named)."""
    env, note = environment(python, work)
    if note:
        say(note)
    missing: dict[str, str | None] = {}
    ran, failed, skipped = 0, [], []
    server: list[Server] = []
    try:
        for b in chosen:
            if b.skip:
                skipped.append(f"{b.name} ({b.skip})")
                continue
            if b.by and not run_by_tests:
                skipped.append(f"{b.name} (run by {b.by})")
                continue
            why = next((w for n in b.needs if (w := missing.setdefault(n, _missing(n, python)))), None)
            if why:
                skipped.append(f"{b.name} ({why})")
                continue
            if b.serve:
                continue  # started for the blocks that need it
            t0 = time.perf_counter()
            block_env = env
            ran += 1
            if "server" in b.needs:
                try:
                    if not server:
                        server.append(Server(serve_block(), work, env))
                except (RuntimeError, LookupError) as e:
                    failed.append(b.name)
                    say(f"readme {b.name} on {device}: FAILED\n    " + str(e).replace("\n", "\n    "))
                    continue
                block_env = server[0].env
            ok, tail = run(b, device, work, block_env, python)
            say(f"readme {b.name} on {device}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
            if not ok:
                failed.append(b.name)
                say("    " + tail.replace("\n", "\n    "))
    finally:
        for s in server:
            s.stop()
    return ran, failed, skipped


def select(names: str | None, slow: bool) -> list[Block]:
    found = all_blocks()
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        by = {b.name: b for b in found}
        for n in wanted:
            if n not in by:
                raise ValueError(f"unknown README block {n!r}; blocks: {', '.join(by)}.")
        return [by[n] for n in wanted]
    return [b for b in found if slow or not b.slow]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/readme_blocks.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="the device every load_model defaults to (cpu, cuda, cuda:N)")
    ap.add_argument("--names", default=None, help="comma list of block names (default: every fast block; with "
                                                  "--slow, every block)")
    ap.add_argument("--slow", action="store_true", help="the slow blocks too (CI's slow step)")
    ap.add_argument("--workdir", type=Path, default=None, help="where blocks run (and write files); default: a "
                                                                "temporary folder outside the checkout")
    ap.add_argument("--list", action="store_true", help="print every block: name, where, how it is checked")
    args = ap.parse_args(argv)
    try:
        chosen = select(args.names, args.slow)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for b in all_blocks():
            how = (f"skip: {b.skip}" if b.skip else " ".join(
                filter(None, ["slow" if b.slow else "fast", "serve" if b.serve else "", "repo" if b.repo else "",
                              f"needs {','.join(b.needs)}" if b.needs else "", f"by {b.by}" if b.by else ""])))
            print(f"{b.name:32s} {b.where:28s} {b.lang:6s} {how}")
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="readme-blocks-"))
    work.mkdir(parents=True, exist_ok=True)
    ran, failed, skipped = check(chosen, args.device, work.resolve(), sys.executable,
                                 lambda s: print(s, flush=True), run_by_tests=bool(args.names))
    print(f"readme blocks on {args.device}: {ran - len(failed)} of {ran} ran"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped {len(skipped)}: {'; '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
