"""python -m engine.zoo list | build [--all | NAMES...] [--force] | path NAME | env"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from . import ZOO, build_twin, offline_env, resolve, zoo_home

    parser = argparse.ArgumentParser(prog="python -m engine.zoo", description="synthetic offline model zoo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="print the table: name, model_type, layers, vllm, quirks")
    p_list.add_argument("patterns", nargs="*", help="names or globs (default: all)")
    p_build = sub.add_parser("build", help="build twins into the zoo cache")
    p_build.add_argument("names", nargs="*", help="names or globs (e.g. 'Qwen/*')")
    p_build.add_argument("--all", action="store_true", help="build every entry")
    p_build.add_argument("--force", action="store_true", help="rebuild even when present")
    p_path = sub.add_parser("path", help="print the snapshot dir of a twin (building it if missing)")
    p_path.add_argument("name")
    sub.add_parser("env", help="print the offline environment (shell export lines)")
    args = parser.parse_args(argv)

    def names_of(patterns: list[str]) -> list[str]:
        out: list[str] = []
        for p in patterns:
            out += [n for n in resolve(p) if n not in out]
        return out

    try:
        if args.cmd == "list":
            names = names_of(args.patterns) if args.patterns else list(ZOO)
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
                snap = build_twin(n, force=args.force)
                print(f"{n}: {snap} ({time.perf_counter() - t0:.1f}s)", flush=True)
        elif args.cmd == "path":
            print(build_twin(resolve(args.name)[0]))
        elif args.cmd == "env":
            for k, v in offline_env().items():
                print(f"export {k}={v}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:  # `python -m engine.zoo list | head`: a closed pipe ends the command quietly (exit 141)
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    sys.exit(code)
