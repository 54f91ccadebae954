"""Side installs: a folder of pinned packages, installed with --no-deps, that a reference engine's child
process puts first on sys.path because the engine needs other versions than .venv holds (nnterp 1.3.0
imports a module nnsight 0.8 removed, so it runs on nnsight 0.7.0 while .venv has 0.8.1).

The pins live in one file (`pins`), which the script that creates the folder (`script`) installs and
stamps; the folder counts as present only while its stamp equals those pins, so a pin moved in the
file and not yet installed is reported with the command that installs it, never run on the old set.
Stdlib only: the registry imports this before anything heavy (`python -m validator --help`).
"""
from __future__ import annotations

import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAMP = ".stamp"  # the file the script writes last, holding the pins it installed (scripts/nnterp_reference.sh)


@dataclass(frozen=True)
class SideInstall:
    folder: str  # relative to the repository (or absolute)
    script: str  # the command's script, relative to the repository
    pins: str  # the pins file, relative to the repository: one requirement a line, `#` comments
    shadows: tuple[str, ...]  # top-level modules the child must import from `folder`, not from .venv
    purpose: str  # what runs from it, for messages ("nnterp on its own nnsight")

    @property
    def path(self) -> Path:
        return REPO / self.folder

    def wanted(self) -> str:
        """The pins as the script stamps them: the requirement lines, space-separated."""
        lines = (REPO / self.pins).read_text().splitlines()
        return " ".join(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))

    def stamp(self) -> str | None:
        """What the folder was last installed with (None: not installed, or the install did not finish)."""
        try:
            return (self.path / STAMP).read_text().strip()
        except OSError:
            return None

    def pinned(self, dist: str) -> str:
        """The pinned version of distribution `dist` (KeyError when the pins do not name it)."""
        return dict(r.split("==", 1) for r in self.wanted().split())[dist]

    def problem(self) -> str:
        """"" when the folder holds the pinned set with every shadowed module in it, else why not and the
        command that fixes it."""
        fix = f"run `bash {self.script}` (scripts/setup.sh does)"
        stamp, want = self.stamp(), self.wanted()
        where = f"{self.purpose} runs from the side directory {self.folder}/"
        if stamp is None:
            return f"{where}, which is missing (or its install did not finish: no {STAMP}): {fix}"
        if stamp != want:
            return f"{where}, which holds {stamp!r} while {self.pins} pins {want!r}: {fix} to reinstall it"
        for mod in self.shadows:
            if importlib.machinery.PathFinder.find_spec(mod, [str(self.path)]) is None:
                return f"{where}, which is stamped but has no {mod!r}: remove it and {fix}"
        return ""
