"""python -m engine.zoo list | build [--all | NAMES...] [--force] | path NAME | env   (each: --size tiny|real)"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from . import SIZE_ENV, SIZES, ZOO, offline_env, resolve, sizes, zoo_home

    parser = argparse.ArgumentParser(prog="python -m engine.zoo", description="synthetic offline model zoo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    size_help = f"twin size: tiny (default, or ${SIZE_ENV}) or real (the checkpoint's real dimensions)"
    p_list = sub.add_parser("list", help="print the table: name, model_type, layers, vllm, quirks")
    p_list.add_argument("patterns", nargs="*", help="names or globs (default: all)")
    p_build = sub.add_parser("build", help="build twins into the zoo cache")
    p_build.add_argument("names", nargs="*", help="names or globs (e.g. 'Qwen/*')")
    p_build.add_argument("--all", action="store_true", help="build every entry")
    p_build.add_argument("--force", action="store_true", help="rebuild even when present")
    p_path = sub.add_parser("path", help="print the snapshot dir of a twin (building it if missing)")
    p_path.add_argument("name")
    p_env = sub.add_parser("env", help="print the offline environment (shell export lines)")
    for p in (p_list, p_build, p_path, p_env):
        p.add_argument("--size", choices=SIZES, default=None, help=size_help)
    args = parser.parse_args(argv)

    def names_of(patterns: list[str]) -> list[str]:
        out: list[str] = []
        for p in patterns:
            out += [n for n in resolve(p) if n not in out]
        return out

    try:
        size = sizes.check_size(args.size or os.environ.get(SIZE_ENV) or "tiny")
        if args.cmd == "list":
            names = names_of(args.patterns) if args.patterns else list(ZOO)
            if size == "real":
                _list_real(names)
                return 0
            w = max(len(n) for n in names)
            t = max(len(ZOO[n].model_type) for n in names)
            print(f"{'name':<{w}}  {'model_type':<{t}}  layers  vllm  quirks")
            for n in names:
                e = ZOO[n]
                print(f"{n:<{w}}  {e.model_type:<{t}}  {e.layers:>6}  {'yes' if e.vllm else 'no ':>4}  {e.notes}")
            print(f"{len(names)} entries; zoo home {zoo_home()}")
        elif args.cmd == "build":
            if args.all:
                names = list(ZOO)
            elif args.names:
                names = names_of(args.names)
            else:
                parser.error("build: give NAMES or --all")
            for n in names:
                t0 = time.perf_counter()
                snap = sizes.ensure(n, size, force=args.force)
                print(f"{n}: {snap} ({time.perf_counter() - t0:.1f}s)", flush=True)
        elif args.cmd == "path":
            print(sizes.ensure(resolve(args.name)[0], size))
        elif args.cmd == "env":
            for k, v in offline_env(size).items():
                print(f"export {k}={v}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _list_real(names: list[str]) -> None:
    """The real-size table: layers, hidden width, published parameters, what is uncertain."""
    from . import REAL, sizes

    w = max(len(n) for n in names)
    print(f"{'name':<{w}}  layers  hidden  params  uncertain")
    for n in names:
        d = REAL[n]
        e = sizes.real_entry(n)
        hidden = next((e.overrides[k] for k in ("hidden_size", "n_embd", "d_model") if k in e.overrides), "?")
        params = f"{d.params_b:g}B" if d.params_b else "?"
        print(f"{n:<{w}}  {d.layers:>6}  {hidden:>6}  {params:>6}  {d.uncertain or '-'}")
    print(f"{len(names)} entries at real size; hub {sizes.hub_cache('real')}")


if __name__ == "__main__":
    try:  # `python -m engine.zoo list | head`: a closed pipe ends the command quietly (exit 141)
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    sys.exit(code)
