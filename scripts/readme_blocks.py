"""The README's Python examples that run as written on the eager backend, found in one place: the tests
execute them on the CPU (and check what they print), and the device script runs them on a GPU.

    python scripts/readme_blocks.py --device cuda [--names quick-start,sae] [--list]

On `--device D` every `load_model(...)` a block makes defaults to D (the README loads on the CPU by
default; an example that builds a tensor on the CPU and hands it to a model elsewhere fails there, so
the examples build theirs on `m.device`). Each block runs in its own process, so one failure costs one
line; the exit status is 1 when any failed. Stdlib only until a block runs.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose engine/ the blocks import
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    name: str
    section: str  # the README heading the block sits under ("## Workflows ...": its first words)
    marker: str = ""  # a text the block contains, when its section holds several

    def code(self, text: str | None = None) -> str:
        """The block's Python source, as the README has it (a `python -c "..."` in a bash block: its argument)."""
        text = README.read_text() if text is None else text
        if f"\n{self.section}" not in text:
            raise LookupError(f"README.md has no section {self.section!r} (block {self.name!r}); update "
                              f"scripts/readme_blocks.py BLOCKS")
        body = text.split(f"\n{self.section}", 1)[1].split("\n## ", 1)[0]
        blocks = re.findall(r"```python\n(.*?)```", body, re.S)
        blocks += [m for b in re.findall(r"```bash\n(.*?)```", body, re.S) for m in re.findall(r'-c "\n(.*?)"\n', b, re.S)]
        hits = [b for b in blocks if self.marker in b]
        if not hits:
            raise LookupError(f"README.md section {self.section!r} has no Python block containing {self.marker!r} "
                              f"(block {self.name!r})")
        return hits[0]


# every README example that runs offline on the eager backend (the vLLM and server ones need those)
BLOCKS = (
    Block("quick-start", "## Quick start", "load_model("),
    Block("sae", "## SAEs and transcoders"),
    Block("readouts", "## Readouts"),
    Block("workflows", "## Workflows"),
    Block("real-saes", "## Readouts", "probe.safetensors"),
)
BY_NAME = {b.name: b for b in BLOCKS}


def get(name: str) -> Block:
    if name not in BY_NAME:
        raise ValueError(f"unknown README block {name!r}; blocks: {', '.join(BY_NAME)}.")
    return BY_NAME[name]


# what runs in the block's process: load_model's device defaults to the chosen one, then the block
_PRELUDE = """
import engine, engine.loading
_load = engine.loading.load_model
def load_model(name, *args, **kw):
    kw.setdefault("device", {device!r})
    return _load(name, *args, **kw)
engine.load_model = engine.loading.load_model = load_model
"""


def run(block: Block, device: str, cwd: Path, python: str = sys.executable, timeout_s: float = 600) -> tuple[bool, str]:
    """Run one block in its own process in `cwd`; (passed, the tail of what it printed)."""
    import os
    code = _PRELUDE.format(device=device) + "\n" + block.code()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"no result within {timeout_s:.0f} s"
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, "\n".join(out[-15:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="the device every load_model defaults to (cpu, cuda, cuda:N)")
    ap.add_argument("--names", default=",".join(BY_NAME), help=f"comma list (default: all: {','.join(BY_NAME)})")
    ap.add_argument("--workdir", type=Path, default=None, help="where blocks run (and write files); default: a "
                                                                "temporary folder")
    ap.add_argument("--list", action="store_true", help="print the blocks' names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(BY_NAME))
        return 0
    try:
        blocks = [get(n.strip()) for n in args.names.split(",") if n.strip()]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tempfile
    work = args.workdir or Path(tempfile.mkdtemp(prefix="readme-blocks-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = []
    for b in blocks:
        t0 = time.perf_counter()
        ok, tail = run(b, args.device, work)
        print(f"readme {b.name} on {args.device}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if not ok:
            failed.append(b.name)
            print("    " + tail.replace("\n", "\n    "), flush=True)
    print(f"readme blocks on {args.device}: {len(blocks) - len(failed)} of {len(blocks)} ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
