"""engine/core/environ.py: variables set for a block, and the environment as it was after it."""
import os

import pytest

from engine.core.environ import scoped_environ


def test_a_scope_sets_its_variables_and_restores_or_removes_each_after(monkeypatch):
    monkeypatch.setenv("INTERP_T_KEPT", "before")
    monkeypatch.delenv("INTERP_T_NEW", raising=False)
    with scoped_environ({"INTERP_T_KEPT": "inside", "INTERP_T_NEW": "1"}):
        assert os.environ["INTERP_T_KEPT"] == "inside" and os.environ["INTERP_T_NEW"] == "1"
    assert os.environ["INTERP_T_KEPT"] == "before" and "INTERP_T_NEW" not in os.environ


def test_a_scope_left_by_an_error_restores_too(monkeypatch):
    monkeypatch.delenv("INTERP_T_NEW", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with scoped_environ({"INTERP_T_NEW": "1"}):
            raise RuntimeError("boom")
    assert "INTERP_T_NEW" not in os.environ
