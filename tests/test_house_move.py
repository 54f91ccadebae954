"""scripts/house_move.py's rewriting, on the import forms the project uses (the coordinator reruns it
on merged trees, so each form must come out right and a second run must change nothing)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("house_move", Path(__file__).resolve().parents[1] / "scripts/house_move.py")
hm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hm)

CASES = [
    ("from engine.steering import Steer\n", "from engine.core.steering import Steer\n"),
    ("    from engine import lens\n", "    from engine.model import lens\n"),
    ("from engine.backends import vllm_attn, vllm_wire\n",
     "from engine.backends.vllm.worker import attn as vllm_attn, wire as vllm_wire\n"),
    ("from engine import options, sources, zoo\n",
     "from engine.model import options, sources\nfrom engine import zoo\n"),
    ("from engine.model import EagerModel\n", "from engine.backends.hf.eager import EagerModel\n"),
    ("import engine.backends.vllm_backend as vb\n", "import engine.backends.vllm.backend as vb\n"),
    ('W = "engine.backends.vllm_worker.InterpWorker"\n', 'W = "engine.backends.vllm.worker.extension.InterpWorker"\n'),
    ('R = "engine.backends.vllm_rows:RowMap"\n', 'R = "engine.backends.vllm.worker.rows:RowMap"\n'),
    ("see engine/backends/vllm_tree.py and vllm_static.py\n",
     "see engine/backends/vllm/worker/tree.py and engine/backends/vllm/worker/static.py\n"),
    ('startswith(("engine/backends/vllm_", "x"))\n', 'startswith(("engine/backends/vllm/", "x"))\n'),
    ("from engine.backends.eager_stream import x  # noqa: F401\n",
     "from engine.backends.hf.stream import x  # noqa: F401\n"),
]


@pytest.mark.parametrize("old,new", CASES)
def test_each_reference_form_is_rewritten_once(old, new):
    assert hm.rewrite_text(old, "engine/some_module.py") == new
    assert hm.rewrite_text(new, "engine/some_module.py") == new  # a second run changes nothing


def test_names_that_only_look_alike_are_left_alone():
    text = ("from engine.zoo import ZOO\nimport engine.families\nx = 'engine.backends.eager_x'\n"
            "tests/test_vllm_static.py engine.model.lens engine.core.points\n"
            "      site_kinds.py   the typed sites; workflows/: attention_capture.py\n")  # names the new layout keeps
    assert hm.rewrite_text(text, "tests/t.py") == text


def test_a_relative_import_in_a_moved_file_becomes_absolute():
    # engine/backends/hf/sites.py was engine/sites.py: `from .errors import X` meant engine.errors
    got = hm.rewrite_text("from .errors import UnsupportedPointError\n", "engine/backends/hf/sites.py")
    assert got == "from engine.core.errors import UnsupportedPointError\n"
    same = "from . import build\n"  # engine/zoo did not move, nor did build
    assert hm.rewrite_text(same, "engine/zoo/__init__.py") == same


def test_the_table_is_consistent():
    news = [n for n in hm.MOVES.values() if n]
    assert len(news) == len(set(news)), "two old files moved to one place"
    assert not set(hm.MOVES) & set(news), "a new path is also an old one: a rerun would move it again"
    assert all(n.startswith("engine/") and n.endswith(".py") for n in news)
