"""Passages keep their section: a Markdown or reStructuredText file read from disk is cut at its headings (no passage
starts inside a heading, between its text and its underline), a long section preferably at its paragraphs, and each
hit names its file, its title and its section; a document not read from a file (a benchmark's paragraph, a text from
Python) is cut at sentences exactly as before. The index runs on the tiny random model (tokenising only)."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from endo_retrieval.cli import main
from endo_retrieval.index.passages import document_cuts, passage_cuts
from endo_retrieval.index.sections import headings, section_metadata

from tiny import tiny_engine

# one line of prose that is nearly a passage long (~230 tokens), so the passage before a heading is full
LONG_LINE = " ".join(f"Routes number {i} are matched in order and the first match wins." for i in range(18))
RST_TEMPLATE = """Routing
=======

{prose}

Registering a route
-------------------

So how do you register a route? Call app.add_route with a path and a view.

Example::

    def register(app):
        app.add_route("/", home)
        return app

{long} {long}

=========
Reference
=========

The router's methods are listed here.
"""


def rst(words: int) -> str:
    """The reStructuredText file, its first section `words` words of one sentence long."""
    return RST_TEMPLATE.format(prose=" ".join(f"route{i % 7}" for i in range(words)), long=LONG_LINE)


def cut_in_an_underline(text: str) -> bool:
    """Whether cutting `text` at sentences alone (as before sections) starts a passage inside an underline."""
    from endo_retrieval.corpus import CorpusMap

    corpus = CorpusMap()
    corpus.add_document("d", text, tiny_engine()[0].encode(text).offsets)
    doc = corpus.doc("d")
    cuts = passage_cuts(doc.sentence_starts, doc.end, 256)
    return any(corpus.span_text(a, a + 1)[3].lstrip().startswith("-") for a in cuts[1:-1])


MARKDOWN = f"""# Deployment

Run it behind a reverse proxy.

## Workers

{LONG_LINE}

```python
# not a heading: a comment in code
workers = 4
```

Tuning
------

Each worker takes one request at a time. {LONG_LINE}
"""


def endo(*args: str) -> tuple[int, str, str]:
    model = ["--model", tiny_engine()[0].source] if args[0] in ("index", "query") else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args, *model])
    return rc, out.getvalue(), err.getvalue()


def test_headings_of_both_markups():
    assert [(h.title, h.level) for h in headings(rst(10), "rst")] == [
        ("Routing", 1), ("Registering a route", 2), ("Reference", 3)]
    assert [(h.title, h.level) for h in headings(MARKDOWN, "markdown")] == [
        ("Deployment", 1), ("Workers", 2), ("Tuning", 2)]  # the # line in the fenced code is no heading
    assert headings("Prose.\n\n    indented\n    ========\n", "rst") == []  # a literal block is no heading


@pytest.fixture
def index(tmp_path, monkeypatch):
    from endo_retrieval.methods.search import EndoIndex

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    text = next(rst(n) for n in range(100, 140) if cut_in_an_underline(rst(n)))  # the case a sentence cut gets wrong
    (tmp_path / "docs" / "routing.rst").write_text(text, encoding="utf-8")
    (tmp_path / "docs" / "deploy.md").write_text(MARKDOWN, encoding="utf-8")
    rc, _, err = endo("index", "docs", "--out", "ix", "--method", "bm25")
    assert rc == 0, err
    return EndoIndex.load("ix", tiny_engine()[0])


def test_every_passage_starts_at_a_heading_or_inside_a_section_never_inside_a_heading(index):
    corpus, passages = index.corpus, index.passages()
    expected = {"routing.rst": ["Routing", "Registering a route", "Reference"],
                "deploy.md": ["Deployment", "Workers", "Tuning"]}
    for doc_id, titles in expected.items():
        doc = corpus.doc(doc_id)
        found = headings(doc.text, "rst" if doc_id.endswith(".rst") else "markdown")
        inner = {h.start + i + 1 for h in found for i, c in enumerate(doc.text[h.start:h.end]) if c == "\n"}
        mine = [i for i in range(len(passages)) if corpus.span_text(int(passages.starts[i]),
                                                                     int(passages.ends[i]))[0] == doc_id]
        starts = [corpus.span_text(int(passages.starts[i]), int(passages.ends[i]))[1] for i in mine]
        assert len(starts) > len(titles)  # long sections hold several passages
        assert not inner & {doc.text.index(doc.text[s:].lstrip()[:1], s) for s in starts}
        for h in found:  # each heading starts a passage
            assert any(doc.text[s:].lstrip().startswith(doc.text[h.start:h.end].lstrip()[:8]) for s in starts)
        sections = [section_metadata(doc, s).get("section") for s in starts]
        assert sections == sorted(sections, key=titles.index) and set(sections) == set(titles)


def test_hits_name_their_file_title_and_section_and_the_text_keeps_its_lines(index):
    rc, out, _ = endo("query", "ix", "How do you register a route?", "--json", "--k", "1", "--method", "bm25")
    hit = json.loads(out)[0]
    assert hit["metadata"] | {"path": None} == {"path": None, "file_name": "routing.rst", "title": "Routing",
                                                  "section": "Registering a route"}
    assert hit["text"].startswith("Registering a route\n-------------------\n\nSo how do you register")
    rc, out, _ = endo("query", "ix", "How do you register a route?", "--k", "1", "--method", "bm25")
    assert out.startswith("[1] routing.rst § Registering a route  chars ")
    assert "\n        def register(app):\n            app.add_route" in out  # code keeps its lines and indent
    rc, out, _ = endo("query", "ix", "How do you register a route?", "--json", "--k", "1", "--method", "bm25",
                      "--whole")
    whole = json.loads(out)[0]
    text = index.corpus.doc("routing.rst").text
    assert whole["text"] == text and whole["metadata"]["section"] == "Registering a route"
    assert text[whole["metadata"]["endo_passage_start"]:].startswith("Registering a route")


def test_a_document_not_read_from_a_file_is_cut_at_sentences_as_before(index):
    from endo_retrieval.methods.search import Document

    text = index.corpus.doc("routing.rst").text
    index.add_documents([Document("plain", text), Document("titled", text, {"title": "Routing"})])
    for doc_id in ("plain", "titled"):
        doc = index.corpus.doc(doc_id)
        assert document_cuts(doc, 256) == passage_cuts(doc.sentence_starts, doc.end, 256)
        assert section_metadata(doc, 0) == {}
    starts = np.asarray(index.passages().starts)
    assert set(passage_cuts(index.corpus.doc("plain").sentence_starts, index.corpus.doc("plain").end, 256)[:-1]) \
        <= set(starts.tolist())
