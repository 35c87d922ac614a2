"""`endo serve`: the JSON `endo query --json` prints, over HTTP from one process (GET and POST), a bad request a 400
that says what to fix, and a new committed generation read at the next question. On the tiny random model (an
index for bm25 and, with a two-head profile, the endo pipeline)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from endo_retrieval.cli import main  # noqa: E402
from endo_retrieval.cli.serve import Served, build_app  # noqa: E402

from tiny import DOCS, tiny_engine  # noqa: E402

QUESTION = "Where is the home port of the Albatross?"


def endo(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main([*args, "--model", tiny_engine()[0].source]) == 0
    return out.getvalue()


def timeless(hits: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "stage_ms"} for h in hits]  # a search's own times differ


@pytest.fixture
def served(tmp_path, monkeypatch):
    profile = tmp_path / "heads.json"  # the endo pipeline's heads on the tiny model
    profile.write_text(json.dumps({"model_hash": tiny_engine()[0].model_hash, "heads": [[0, 0], [1, 1]],
                                   "fusion": {"weights": {"heads": 1.0}}}))
    monkeypatch.setenv("ENDO_HEADS_PROFILE", str(profile))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    for name in ("ship", "cafe", "vault"):
        (tmp_path / "docs" / f"{name}.md").write_text(f"# {name.title()}\n\n{DOCS[name]}\n", encoding="utf-8")
    endo("index", "docs", "--out", "ix", "--method", "bm25")
    return Served(tmp_path / "ix", tiny_engine()[0].source)


def test_answers_as_endo_query_json_does(served):
    client = TestClient(build_app(served))
    for extra, fields in (([], {}), (["--whole"], {"whole": "true"}), (["--method", "endo"], {"method": "endo"}),
                          (["--method", "endo", "--passages"], {"method": "endo", "passages": "1"})):
        expected = json.loads(endo("query", "ix", QUESTION, "--k", "2", "--json", *extra))
        got = client.get("/query", params={"q": QUESTION, "k": 2, **fields})
        assert got.status_code == 200 and timeless(got.json()) == timeless(expected), extra
        posted = client.post("/query", json={"question": QUESTION, "k": 2, **fields})
        assert timeless(posted.json()) == timeless(expected)
    assert client.get("/query", params={"q": QUESTION}).json()[0]["metadata"]["section"] == "Ship"
    assert client.get("/health").json() | {"model": None} == {"index": str(served.folder), "generation": 1,
                                                              "method": "bm25", "model": None, "documents": 3}


@pytest.mark.parametrize("params, message", [
    ({}, "ask with a question"), ({"q": "  "}, "The question is empty"), ({"q": "x", "k": "-1"}, "k must be"),
    ({"q": "x", "k": "two"}, "k must be a whole number"), ({"q": "x", "method": "magic"}, "method must be one of"),
    ({"q": "x", "read_tokens": "4"}, "read_tokens must be a whole number >= 8"),
    ({"q": "x", "passages": "1", "whole": "1"}, "not both"), ({"q": "x", "depth": "3"}, "tune the endo pipeline")])
def test_a_bad_request_is_a_400_that_says_what_to_fix(served, params, message):
    got = TestClient(build_app(served)).get("/query", params=params)
    assert got.status_code == 400 and message in got.json()["error"]


def test_a_new_generation_is_read_at_the_next_question(served, tmp_path):
    client = TestClient(build_app(served))
    assert client.get("/query", params={"q": "lighthouse", "k": 1}).json() == []
    (tmp_path / "docs" / "light.md").write_text("The lighthouse on the cape was lit in 1877.", encoding="utf-8")
    endo("index", "docs", "--out", "ix", "--append")
    assert client.get("/query", params={"q": "lighthouse", "k": 1}).json()[0]["doc_id"] == "light.md"
    assert client.get("/health").json()["generation"] == 2
