"""Whole documents, relevance scores, and progress where the model's read is long, checked through the real
frameworks on the tiny random model of tests/tiny.py (plumbing in seconds, not quality):
- LangChain retriever hits carry `relevance_score` (and `endo_score`, as before);
- `return_document=True` on both retrievers hands back the whole document, its best passage's offsets in the metadata;
- both rerankers take `read_tokens` (each candidate's best part) and `progress`;
- a read expected (or found) to take more than a few seconds shows a progress bar when asked and logs once a hint
  that names the faster settings."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from endo_retrieval import integrations  # noqa: E402
from endo_retrieval.methods import read_time  # noqa: E402

FILLER = " ".join(f"Sentence {i} tells of the old mill by the river." for i in range(60))
TEXTS = [FILLER + " The miller Jonas Eberle sold the mill in 1911. " + FILLER,
         "The Zephyr bridge crosses the Varna river. It was painted bright green in 1932.",
         "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971.",
         "The research ship Albatross has its home port in Gdansk on the Baltic coast."]
QUESTION = "Who sold the mill in 1911?"


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """The tiny model with a two-head retrieval-heads profile (found through ENDO_HEADS_PROFILE)."""
    from tiny import tiny_engine

    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"model_hash": tiny_engine()[0].model_hash, "heads": [[0, 0], [1, 1]],
                                   "fusion": {"weights": {"heads": 1.0}}}))
    monkeypatch.setenv("ENDO_HEADS_PROFILE", str(profile))
    return tiny_engine()[0]


@pytest.fixture
def fresh_hints(monkeypatch):
    """No hint logged yet in this process, and no read timed (each test starts from the prior)."""
    monkeypatch.setattr(read_time, "_hinted", set())
    monkeypatch.setattr(read_time, "_rates", read_time.weakref.WeakKeyDictionary())


def lc_retriever(backbone, **kwargs):
    from langchain_core.documents import Document

    from langchain_endo import EndoRetriever

    docs = [Document(page_content=t, id=f"d{i}", metadata={"n": i}) for i, t in enumerate(TEXTS)]
    return EndoRetriever(documents=docs, backbone=backbone, **kwargs)


def li_retriever(backbone, **kwargs):
    from llama_index.core import Document
    from llama_index.retrievers.endo import EndoRetriever

    docs = [Document(id_=f"d{i}", text=t, metadata={"n": i}) for i, t in enumerate(TEXTS)]
    return EndoRetriever.from_defaults(documents=docs, backbone=backbone, **kwargs)


# ---- relevance_score -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["endo", "bm25"])
def test_langchain_hits_carry_relevance_score_beside_endo_score(tiny, method):
    hits = lc_retriever(tiny, method=method).invoke(QUESTION, k=3)
    assert hits and all(h.metadata["relevance_score"] == h.metadata["endo_score"] for h in hits)
    scores = [h.metadata["relevance_score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and all(isinstance(s, float) for s in scores)


# ---- return_document ------------------------------------------------------------------------------------------------
def test_langchain_return_document_hands_back_whole_documents_with_the_passage_offsets(tiny):
    passages = lc_retriever(tiny).invoke(QUESTION, k=3)
    documents = lc_retriever(tiny, return_document=True).invoke(QUESTION, k=3)
    assert [d.id for d in documents] == [p.id for p in passages]  # the same ranking, by the best passage
    for passage, document in zip(passages, documents):
        text = TEXTS[document.metadata["n"]]
        assert document.page_content == text
        assert (document.metadata["char_start"], document.metadata["char_end"]) == (0, len(text))
        a, b = document.metadata["endo_passage_start"], document.metadata["endo_passage_end"]
        assert (a, b) == (passage.metadata["char_start"], passage.metadata["char_end"])
        assert text[a:b] == passage.page_content
        assert document.metadata["relevance_score"] == passage.metadata["relevance_score"]
    assert len(passages[0].page_content) < len(TEXTS[0]) or passages[0].id != "d0"  # a passage, not the document


def test_llamaindex_return_document_hands_back_whole_nodes_and_persists(tiny, tmp_path):
    passages = li_retriever(tiny, similarity_top_k=3).retrieve(QUESTION)
    retriever = li_retriever(tiny, similarity_top_k=3, return_document=True)
    nodes = retriever.retrieve(QUESTION)
    assert [n.node.node_id for n in nodes] == [p.node.node_id for p in passages]
    for passage, hit in zip(passages, nodes):
        text = TEXTS[hit.node.metadata["n"]]
        assert hit.node.text == text and hit.score == passage.score
        assert (hit.node.start_char_idx, hit.node.end_char_idx) == (0, len(text))
        a, b = hit.node.metadata["endo_passage_start"], hit.node.metadata["endo_passage_end"]
        assert text[a:b] == passage.node.text
        assert "endo_passage_start" in hit.node.excluded_llm_metadata_keys  # offsets are for code, not the prompt
    retriever.persist(tmp_path / "p")
    from llama_index.retrievers.endo import EndoRetriever

    again = EndoRetriever.from_persist_dir(tmp_path / "p", backbone=tiny)
    assert again.return_document and [n.node.text for n in again.retrieve(QUESTION)] == [n.node.text for n in nodes]


@pytest.mark.parametrize("method", ["bm25"])
def test_return_document_works_for_every_method_and_k_zero_still_returns_nothing(tiny, method):
    hits = lc_retriever(tiny, method=method, return_document=True).invoke(QUESTION, k=2)
    assert all(h.page_content == TEXTS[h.metadata["n"]] for h in hits) and hits
    assert lc_retriever(tiny, return_document=True).invoke(QUESTION, k=0) == []
    assert li_retriever(tiny, similarity_top_k=0, return_document=True).retrieve(QUESTION) == []


def test_return_document_and_return_passages_are_refused_together(tiny):
    with pytest.raises(ValueError, match="return_document=True returns each hit's whole document"):
        lc_retriever(tiny, return_document=True, return_passages=True)
    with pytest.raises(ValueError, match="return_document=True returns each hit's whole document"):
        li_retriever(tiny, return_document=True, return_passages=True)


# ---- the rerankers read less when asked -----------------------------------------------------------------------------
def test_reranker_read_tokens_reads_each_candidates_best_part(tiny, monkeypatch):
    from endo_retrieval.methods import heads as retrieval_heads

    read = {}

    def spy(backbone, passages, question, heads=None):
        read["texts"] = list(passages)
        return retrieval_heads.passage_signals(backbone, passages, question, heads)["heads"]

    monkeypatch.setattr(retrieval_heads, "rank_passages", spy)
    integrations.rerank_passages(TEXTS, QUESTION, 2, tiny, read_tokens=32)
    assert all(tiny.count_tokens(t) <= 32 + 4 for t in read["texts"])  # ' ... ' joins may add a token or two
    assert any("Jonas Eberle" in t for t in read["texts"])  # the best part holds the question's words
    integrations.rerank_passages(TEXTS, QUESTION, 2, tiny)
    assert sorted(read["texts"]) == sorted(TEXTS)  # without it: whole, as they fit the window


def test_both_rerankers_take_read_tokens_and_refuse_a_bad_one(tiny):
    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.endo import EndoReranker as LIReranker

    from langchain_endo import EndoReranker as LCReranker

    docs = [Document(page_content=t, id=f"d{i}") for i, t in enumerate(TEXTS)]
    ranked = LCReranker(top_n=2, backbone=tiny, read_tokens=32).compress_documents(docs, QUESTION)
    assert len(ranked) == 2 and all(d.page_content in TEXTS for d in ranked)  # the documents, not what was read
    nodes = [NodeWithScore(node=TextNode(text=t, id_=f"d{i}"), score=1.0 - i / 10) for i, t in enumerate(TEXTS)]
    out = LIReranker(top_n=2, backbone=tiny, read_tokens=32).postprocess_nodes(nodes, query_str=QUESTION)
    assert len(out) == 2 and all(n.node.text in TEXTS for n in out)
    for bad in (4, 0, 2.5, True, "64"):
        with pytest.raises(ValueError, match="read_tokens must be a whole number of tokens >= 8"):
            LCReranker(backbone=tiny, read_tokens=bad)
        with pytest.raises(ValueError, match="read_tokens must be a whole number of tokens >= 8"):
            LIReranker(backbone=tiny, read_tokens=bad)


# ---- progress and the hint ------------------------------------------------------------------------------------------
def rerank_through_both(tiny, **kwargs):
    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.endo import EndoReranker as LIReranker

    from langchain_endo import EndoReranker as LCReranker

    LCReranker(top_n=2, backbone=tiny, **kwargs).compress_documents(
        [Document(page_content=t) for t in TEXTS], QUESTION)
    LIReranker(top_n=2, backbone=tiny, **kwargs).postprocess_nodes(
        [NodeWithScore(node=TextNode(text=t), score=1.0) for t in TEXTS], query_str=QUESTION)


def test_a_slow_rerank_shows_a_bar_when_asked_and_logs_the_hint_once(tiny, fresh_hints, monkeypatch, capsys, caplog):
    monkeypatch.setattr(read_time, "SLOW_S", 0.0)  # every read counts as slow
    caplog.set_level(logging.WARNING, logger="endo_retrieval.methods.read_time")
    rerank_through_both(tiny, progress=True)
    err = capsys.readouterr().err
    assert "reranking 4 passages" in err  # tqdm's bar, on standard error
    hints = [r.getMessage() for r in caplog.records if "faster:" in r.getMessage()]
    assert len(hints) == 1, hints  # once per process, not once per call
    assert "read_tokens=128" in hints[0] and "fewer candidates" in hints[0] and "similarity_top_k or k" in hints[0]
    rerank_through_both(tiny, progress=False)
    assert "reranking" not in capsys.readouterr().err


def test_no_bar_and_no_hint_where_the_read_is_quick(tiny, fresh_hints, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="endo_retrieval.methods.read_time")
    rerank_through_both(tiny, progress=True)  # the tiny model reads in milliseconds
    assert "reranking" not in capsys.readouterr().err
    assert not [r for r in caplog.records if "faster:" in r.getMessage()]


def test_a_slow_retrieval_shows_a_bar_when_asked_and_names_the_faster_settings(tiny, fresh_hints, monkeypatch,
                                                                              capsys, caplog):
    monkeypatch.setattr(read_time, "SLOW_S", 0.0)
    caplog.set_level(logging.WARNING, logger="endo_retrieval.methods.read_time")
    lc_retriever(tiny, progress=True).invoke(QUESTION, k=2)
    li_retriever(tiny, progress=True).retrieve(QUESTION)
    assert "the endo pipeline's read" in capsys.readouterr().err
    hints = [r.getMessage() for r in caplog.records if "faster:" in r.getMessage()]
    assert len(hints) == 1 and all(word in hints[0] for word in ("depth=", "read_tokens=", 'method="bm25"'))
    lc_retriever(tiny, progress=False).invoke(QUESTION, k=2)
    assert "pipeline" not in capsys.readouterr().err


def test_the_read_time_is_expected_from_the_models_size_on_a_cpu_then_from_its_own_reads(fresh_hints):
    import torch

    class Stand:  # a CPU backbone of SmolLM2-135M's size
        device = torch.device("cpu")
        model = torch.nn.Linear(1, 1)

    bb = Stand()
    read_time._params[bb] = read_time.REFERENCE_PARAMS
    # the case: a reranker over 20 whole documents (~8k tokens) on a CPU is slow; the pipeline's 12 x 128 not
    assert read_time.expected_seconds(bb, 8000) > read_time.SLOW_S
    assert read_time.expected_seconds(bb, 12 * 128) < read_time.SLOW_S
    read_time._timed(bb, 1000, 10.0)  # a read of 1,000 tokens took 10 s: a busy machine
    assert read_time.expected_seconds(bb, 1000) == pytest.approx(10.0)
    gpu = type("Gpu", (), {"device": torch.device("cuda"), "model": None})()
    assert read_time.expected_seconds(gpu, 10**6) is None  # an accelerator: fast until timed otherwise


def test_a_read_found_slow_logs_the_hint_after_it(fresh_hints, monkeypatch, caplog):
    import time

    import torch

    class Stand:
        device = torch.device("cpu")
        model = None

    monkeypatch.setattr(read_time, "SLOW_S", 0.05)
    caplog.set_level(logging.WARNING, logger="endo_retrieval.methods.read_time")
    bb = Stand()
    read_time._rates[bb] = 1e12  # expected instantly
    with read_time.long_read(bb, 100, "reranking 3 passages", "read_tokens=128", "rerank", progress=False):
        time.sleep(0.1)
    assert any("took" in r.getMessage() and "read_tokens=128" in r.getMessage() for r in caplog.records)


# ---- quiet by default ------------------------------------------------------------------------------------------------
def test_the_minilm_embedding_loads_without_a_word():
    pytest.importorskip("sentence_transformers")
    code = ("from llama_index.postprocessor.endo import MiniLMEmbedding\n"
            "print(len(MiniLMEmbedding().get_text_embedding('The ship is based in Gdansk.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (done.stdout, done.stderr) == ("384\n", "")  # no "Loading weights" bar, no LOAD REPORT
