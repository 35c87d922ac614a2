"""k means k: asked for k documents, both retrievers and `endo query` return k whenever the corpus holds k that
match, even where a few long documents hold all of the best passages the model reads first (it then reads deeper);
fewer come back only when fewer exist, with a warning saying why. On the tiny random model of tests/tiny.py with a
small depth, so the first read's candidates come from few documents (plumbing, not quality)."""
from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

PLACES = ["mill", "river", "bridge", "harbor", "market", "chapel", "orchard", "forge", "tower", "meadow"]
# six long documents (several passages each, every one naming every place) and six short ones, two places each
LONG = [" ".join(f"In year {1900 + 10 * d + s} the {p} of Valdor {d} was repaired by the guild of {p}s."
                 for s in range(4) for p in PLACES) for d in range(6)]
SHORT = [f"The {PLACES[i]} and the {PLACES[(i + 3) % 10]} of Kessel {i} are small." for i in range(6)]
TEXTS = LONG + SHORT
QUESTIONS = [f"When was the {a} of Valdor repaired by the guild?" for a in PLACES] + \
            [f"Which {a} stands beside the {b}?" for a, b in zip(PLACES, PLACES[3:] + PLACES[:3])]
K, DEPTH = 5, 4


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """The tiny model with a two-head retrieval-heads profile (found through ENDO_HEADS_PROFILE)."""
    from tiny import tiny_engine

    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"model_hash": tiny_engine()[0].model_hash, "heads": [[0, 0], [1, 1]],
                                   "fusion": {"weights": {"heads": 1.0}}}))
    monkeypatch.setenv("ENDO_HEADS_PROFILE", str(profile))
    return tiny_engine()[0]


def test_the_first_read_alone_would_return_fewer(tiny):
    """The case the tests below cover: the depth best passages come from fewer than k documents."""
    from langchain_endo import EndoRetriever

    index = EndoRetriever(texts=TEXTS, backbone=tiny, k=K, depth=DEPTH)._index
    short = [q for q in QUESTIONS if len({s.doc_id for s in index.search(q, K, depth=DEPTH)}) < K]
    assert len(short) >= 10


def test_both_retrievers_return_k_documents_for_all_twenty_questions(tiny, caplog):
    from langchain_endo import EndoRetriever as LCRetriever
    from llama_index.core import Document
    from llama_index.retrievers.endo import EndoRetriever as LIRetriever

    lc = LCRetriever(texts=TEXTS, backbone=tiny, k=K, depth=DEPTH)
    li = LIRetriever.from_defaults(documents=[Document(text=t, id_=f"d{i}") for i, t in enumerate(TEXTS)],
                                   backbone=tiny, similarity_top_k=K, depth=DEPTH)
    with caplog.at_level(logging.WARNING, logger="endo_retrieval.integrations"):
        for question in QUESTIONS:
            docs = lc.invoke(question)
            assert len(docs) == K and len({d.metadata["doc_id"] for d in docs}) == K, question
            nodes = li.retrieve(question)
            assert len(nodes) == K and len({n.node.ref_doc_id for n in nodes}) == K, question
    assert "documents asked for" not in caplog.text


def test_fewer_only_when_fewer_exist_with_a_warning(tiny, caplog):
    from langchain_endo import EndoRetriever

    retriever = EndoRetriever(texts=TEXTS[:3], backbone=tiny, k=K, depth=DEPTH)
    with caplog.at_level(logging.WARNING, logger="endo_retrieval.integrations"):
        assert len(retriever.invoke(QUESTIONS[0])) == 3
    assert "3 of the 5 documents asked for: the index holds no more documents" in caplog.text


def test_the_command_line_returns_k_documents_and_k_passages(tiny, tmp_path, capsys):
    from endo_retrieval.cli import main

    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    model = ["--model", tiny.source]
    assert main(["index", str(folder), "--out", str(tmp_path / "ix"), "--first-stage", "bm25", *model]) == 0
    capsys.readouterr()
    for shape in ([], ["--passages"], ["--whole"]):
        assert main(["query", str(tmp_path / "ix"), QUESTIONS[0], "--k", str(K), "--depth", str(DEPTH), "--json",
                     *shape, *model]) == 0
        hits = json.loads(capsys.readouterr().out)
        assert len(hits) == K and (shape == ["--passages"] or len({h["doc_id"] for h in hits}) == K)
