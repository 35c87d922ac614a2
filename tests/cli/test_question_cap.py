"""A question longer than MAX_QUESTION_CHARS is cut, with a warning, wherever it enters: compress(), EndoIndex.search
and so `endo query` / `endo compress` (on the tiny random model: BM25 reads only tokens)."""
import warnings

import pytest

from endo_retrieval.cli import main
from endo_retrieval.core import MAX_QUESTION_CHARS, capped_question

from tiny import DOCS, docs, new_index, tiny_engine

LONG = "Where is the home port? " * (MAX_QUESTION_CHARS // 10)


def test_a_long_question_is_cut_with_a_warning_and_a_short_one_is_not():
    with pytest.warns(UserWarning, match=f"has {len(LONG):,} characters; only its first {MAX_QUESTION_CHARS:,}"):
        assert capped_question(LONG) == LONG[:MAX_QUESTION_CHARS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capped_question(LONG[:MAX_QUESTION_CHARS]) == LONG[:MAX_QUESTION_CHARS]


def test_compress_reads_the_cut_question(monkeypatch):
    import endo_retrieval.methods as methods

    asked = []

    class Recorder:
        def compress(self, context, question, budget):
            asked.append(question)

    monkeypatch.setattr(methods, "get_method", lambda name, **kw: Recorder())
    with pytest.warns(UserWarning, match="only its first"):
        methods.compress(DOCS["ship"], LONG, budget=16, method="bm25", backbone=tiny_engine()[0])
    assert asked == [LONG[:MAX_QUESTION_CHARS]]


def test_search_reads_the_cut_question(monkeypatch):
    index = new_index("bm25")
    index.add_documents(docs("ship", "cafe"))
    asked, scores = [], index.signal_scores
    monkeypatch.setattr(index, "signal_scores", lambda question, method=None: asked.append(question) or
                        scores(question, method))
    with pytest.warns(UserWarning, match="only its first"):
        assert index.search(LONG, k=1)
    assert asked == [LONG[:MAX_QUESTION_CHARS]]


def test_endo_query_warns_in_one_line(tmp_path, capsys):
    backbone, _ = tiny_engine()
    (tmp_path / "ship.txt").write_text(DOCS["ship"], encoding="utf-8")
    model = ["--model", backbone.source]
    assert main(["index", str(tmp_path / "ship.txt"), "--out", str(tmp_path / "ix"), "--method", "bm25", *model]) == 0
    capsys.readouterr()
    assert main(["query", str(tmp_path / "ix"), LONG, "--k", "1", *model]) == 0
    err = capsys.readouterr().err
    assert err == (f"endo query: warning: The question has {len(LONG):,} characters; only its first "
                   f"{MAX_QUESTION_CHARS:,} are read. Put long material into the context or the indexed documents "
                   "instead.\n")
