"""One name where a user reads it (issue 36): the distribution's, interp-standard, in the README's title,
the site's header and the server's `owned_by`; interp-engine names only the published package we
validate against, and the README says once how the two relate."""
from __future__ import annotations

import pathlib
import re
import tomllib
from types import SimpleNamespace

from engine.core import DISTRIBUTION

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_name_is_the_distributions():
    assert DISTRIBUTION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "interp-standard"


def test_the_readme_title_and_how_the_two_names_relate():
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[0] == f"# {DISTRIBUTION}"
    said = [p for p in readme.split("\n\n") if "`interp-engine` is another project" in p]
    assert len(said) == 1 and "validate against" in said[0] and DISTRIBUTION in said[0]


def test_the_site_says_the_distributions_name():
    web = ROOT / "visualizer-web"
    sources = {p: p.read_text() for p in [*web.glob("src/*.ts"), web / "build.mjs"]}
    assert not [str(p) for p, t in sources.items() if re.search(r"interp engine", t, re.I)]
    dom = sources[web / "src" / "dom.ts"]
    assert f'{{ class: "brand", href: "index.html" }}, "{DISTRIBUTION}")' in dom  # the header
    assert f"<title>{DISTRIBUTION}</title>" in sources[web / "build.mjs"]


def test_the_server_says_who_owns_the_model():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from engine.serve import routes
    app = FastAPI()
    routes.register(app)
    app.state.ctx = SimpleNamespace(served=["tiny"], metrics=SimpleNamespace(started=0.0),
                                    runner=SimpleNamespace(name="meta-llama/Llama-3.2-1B", max_model_len=512))
    got = TestClient(app).get("/v1/models").json()["data"]
    assert [(m["id"], m["owned_by"], m["root"]) for m in got] == [("tiny", DISTRIBUTION, "meta-llama/Llama-3.2-1B")]
