"""Each command's --help lists its choices from their registries (variants, workloads, engines, backends), not
from a copy, and shows an example that parses (issue 51: `benchmarks run --help` listed no variant or workload,
`python -m benchmarks --help` pointed at a source file)."""
from __future__ import annotations

import argparse
import shlex

import pytest

from benchmarks import variants, workloads
from engine.core.backends import CAPTURE_BACKENDS


def _help(parser: argparse.ArgumentParser, *argv: str) -> str:
    for a in parser._actions:  # the subcommand's own parser, as `prog SUB --help` prints it
        if isinstance(a, argparse._SubParsersAction) and argv:
            return a.choices[argv[0]].format_help()
    return parser.format_help()


def _examples(text: str, prog: str) -> list[list[str]]:
    """The example commands a help text shows below its "example" heading (continuation lines joined), as argv
    after `prog`."""
    joined = text.split("\nexample", 1)[1].replace("\\\n", " ")
    return [shlex.split(line.split("#", 1)[0])[len(prog.split()):] for line in joined.splitlines()
            if line.strip().startswith(prog + " ")]


@pytest.mark.parametrize("argv", [(), ("run",)], ids=["benchmarks", "benchmarks run"])
def test_benchmarks_help_lists_every_variant_and_workload_and_an_example(argv):
    from benchmarks.__main__ import build_parser
    text = _help(build_parser(), *argv)
    for v in variants.VARIANTS:
        assert f"\n  {v.name} " in text and v.title in text, v.name
    for w in workloads.WORKLOADS:
        assert f"\n  {w.name} " in text and w.title in text, w.name
    assert "benchmarks/__init__.py" not in text
    cmds = _examples(text, "python -m benchmarks")
    assert cmds and cmds[0][0] == "run"
    args = build_parser().parse_args(cmds[0])
    assert set(args.variants) <= set(variants.NAMES) and set(args.workloads) <= set(workloads.NAMES)


def test_validator_run_help_lists_every_engine_and_examples_that_parse():
    from validator.cli import build_parser
    from validator.engines import ENGINES
    text = _help(build_parser(), "run")
    assert all(e in text for e in ENGINES) and "python -m engine.zoo list" in text
    cmds = _examples(text, "python -m validator")
    assert len(cmds) >= 3 and any("--models" in c for c in cmds)
    for c in cmds:
        build_parser().parse_args(c)


def test_serve_help_lists_every_backend_with_what_it_is_and_an_example():
    from engine.core.backends import backend_for
    from engine.serve.__main__ import parser
    text = parser().format_help()
    for b in CAPTURE_BACKENDS:
        assert f"\n  {b} " in text and backend_for(b).summary in text
    [cmd] = _examples(text, "python -m engine.serve")
    assert parser().parse_args(cmd).backend in CAPTURE_BACKENDS
