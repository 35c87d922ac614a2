"""What LlamaIndex and LangChain users expect of the adapters, checked through the real frameworks on a tiny random
model (fast; the ranking quality is the slow tests' job): async takes what sync takes and returns the same, one rule
for k, deletes as each framework's stores do them, one hit per document, LangChain's filter operators and score
thresholds, and the reranker's fusion with the first stage."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

FILLER = " ".join(f"Sentence {i} tells of the old mill by the river." for i in range(60))
TINY_TEXTS = [  # the first is long enough to be cut into several passages, so one document can fill several hits
    FILLER,
    "The Zephyr bridge crosses the Varna river. It was painted bright green in 1932.",
    "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971.",
    "The Orion cafe serves espresso. It opens at seven every weekday.",
    "The research ship Albatross has its home port in Gdansk on the Baltic coast.",
]
TOPICS = ["mill", "travel", "science", "food", "travel"]
YEARS = [1850, 1932, 1971, 2001, 1988]
QUESTION = "Which compound did Marta Kowal discover in 1971?"


@pytest.fixture
def tiny_profile(monkeypatch, tmp_path):
    """A retrieval-heads profile (two heads) for the tiny random model of tests/tiny.py, found through
    ENDO_HEADS_PROFILE; its path, for tests that add a section to it."""
    from tiny import tiny_engine

    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"model_hash": tiny_engine()[0].model_hash, "heads": [[0, 0], [1, 1]],
                                   "fusion": {"weights": {"heads": 1.0}}}))
    monkeypatch.setenv("ENDO_HEADS_PROFILE", str(profile))
    return profile


@pytest.fixture
def tiny(tiny_profile):
    """The tiny model (random weights, the default model's tokenizer), ready for the `endo` pipeline and the
    reranker: plumbing in seconds, not quality."""
    from tiny import tiny_engine

    return tiny_engine()[0]


def lc_retriever(backbone, **kwargs):
    from langchain_core.documents import Document

    from langchain_endo import EndoRetriever

    docs = [Document(page_content=t, id=f"d{i}", metadata={"topic": TOPICS[i], "year": YEARS[i]})
            for i, t in enumerate(TINY_TEXTS)]
    return EndoRetriever(documents=docs, backbone=backbone, **kwargs)


def li_retriever(backbone, **kwargs):
    from llama_index.core import Document
    from llama_index.retrievers.endo import EndoRetriever

    docs = [Document(id_=f"d{i}", text=t, metadata={"topic": TOPICS[i], "year": YEARS[i]})
            for i, t in enumerate(TINY_TEXTS)]
    return EndoRetriever.from_defaults(documents=docs, backbone=backbone, **kwargs)


def lc_hits(docs) -> list[tuple]:
    """What a LangChain hit says, without the timings (they differ from call to call)."""
    return [(d.id, d.page_content, {k: v for k, v in d.metadata.items() if k != "endo_stage_ms"}) for d in docs]


def li_hits(nodes) -> list[tuple]:
    return [(n.node.node_id, n.node.text, n.score,
             {k: v for k, v in n.node.metadata.items() if k != "endo_stage_ms"}) for n in nodes]


# ---- async parity ---------------------------------------------------------------------------------------------------
LC_KEYWORDS = [{}, {"k": 2}, {"k": 0}, {"filter": {"topic": "travel"}}, {"k": 1, "filter": {"topic": "science"}}]


@pytest.mark.parametrize("kwargs", LC_KEYWORDS, ids=str)
def test_langchain_ainvoke_takes_the_keywords_invoke_takes_and_agrees(tiny, kwargs):
    retriever = lc_retriever(tiny)
    sync = retriever.invoke(QUESTION, **kwargs)
    assert len(sync) == {0: 0, 1: 1, 2: 2}.get(kwargs.get("k"), len(sync)) and (sync or kwargs.get("k") == 0)
    assert lc_hits(asyncio.run(retriever.ainvoke(QUESTION, **kwargs))) == lc_hits(sync)


def test_llamaindex_aretrieve_and_aquery_agree_with_the_sync_paths(tiny):
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.postprocessor.endo import EndoReranker

    retriever = li_retriever(tiny, similarity_top_k=3)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(max_tokens=4),
                                            node_postprocessors=[EndoReranker(top_n=2, backbone=tiny)])
    sync = retriever.retrieve(QUESTION)
    assert len(sync) == 3
    assert li_hits(asyncio.run(retriever.aretrieve(QUESTION))) == li_hits(sync)
    answer = engine.query(QUESTION)
    assert len(answer.source_nodes) == 2
    assert li_hits(asyncio.run(engine.aquery(QUESTION)).source_nodes) == li_hits(answer.source_nodes)


# ---- one rule for k -------------------------------------------------------------------------------------------------
def test_k_zero_returns_nothing_and_a_negative_k_is_refused_everywhere(tiny):
    lc = lc_retriever(tiny)
    assert lc.invoke(QUESTION, k=0) == [] and asyncio.run(lc.ainvoke(QUESTION, k=0)) == []
    assert lc_retriever(tiny, k=0).invoke(QUESTION) == []
    li = li_retriever(tiny, similarity_top_k=0)
    assert li.retrieve(QUESTION) == [] and asyncio.run(li.aretrieve(QUESTION)) == []
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match=r"k must be a whole number >= 0"):
            lc.invoke(QUESTION, k=bad)
        with pytest.raises(ValueError, match=r"k must be a whole number >= 0"):
            asyncio.run(lc.ainvoke(QUESTION, k=bad))
        with pytest.raises(ValueError, match=r"k must be a whole number >= 0"):
            lc_retriever(tiny, k=bad)
        with pytest.raises(ValueError, match=r"similarity_top_k must be a whole number >= 0"):
            li_retriever(tiny, similarity_top_k=bad)
    li.similarity_top_k = -1  # set after construction, as code that widens its ask does
    with pytest.raises(ValueError, match=r"similarity_top_k must be a whole number >= 0"):
        li.retrieve(QUESTION)


# ---- deletes as each framework's stores do them ---------------------------------------------------------------------
def test_llamaindex_delete_ref_doc_warns_on_an_unknown_id_and_raises_only_when_asked(tiny, caplog):
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.retrievers.endo import EndoRetriever

    docs = [Document(id_="long", text=TINY_TEXTS[0]), Document(id_="ship", text=TINY_TEXTS[4])]
    nodes = SentenceSplitter(chunk_size=128, chunk_overlap=0).get_nodes_from_documents(docs)
    assert len([n for n in nodes if n.ref_doc_id == "long"]) > 1
    retriever = EndoRetriever.from_defaults(nodes=nodes, backbone=tiny)
    before = retriever.index.doc_ids
    with caplog.at_level("WARNING"):
        retriever.delete_ref_doc("unknown")
    assert "unknown" in caplog.text and "nothing deleted" in caplog.text
    with pytest.raises(ValueError, match="'unknown' not found"):
        retriever.delete_ref_doc("unknown", raise_error=True)
    assert retriever.index.doc_ids == before
    retriever.delete_ref_doc("long")  # every node parsed from the document goes
    assert retriever.index.doc_ids == [n.node_id for n in nodes if n.ref_doc_id == "ship"]
    asyncio.run(retriever.adelete_ref_doc("ship"))
    assert retriever.index.doc_ids == []


def test_langchain_delete_says_whether_anything_was_removed(tiny):
    retriever = lc_retriever(tiny)
    assert retriever.delete(["unknown"]) is False and len(retriever.index.doc_ids) == len(TINY_TEXTS)
    assert retriever.delete(["d1", "unknown", "d1"]) is True and "d1" not in retriever.index.doc_ids
    assert asyncio.run(retriever.adelete(["d2"])) is True and asyncio.run(retriever.adelete(["d2"])) is False
    assert retriever.index.doc_ids == ["d0", "d3", "d4"]
    with pytest.raises(ValueError, match="list of document ids"):
        retriever.delete("d0")  # a bare string is not a list of ids (it would be read as ids 'd' and '0')


# ---- one hit per node / document ------------------------------------------------------------------------------------
MILL_QUESTION = "Which sentence tells of the old mill by the river?"  # the long first text's passages rank high


def without_timings(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "endo_stage_ms"}


def test_langchain_hits_are_distinct_documents_each_with_its_best_passage(tiny):
    passages = lc_retriever(tiny, return_passages=True).invoke(MILL_QUESTION, k=20)
    doc_ids = [p.metadata["doc_id"] for p in passages]
    assert len(doc_ids) > len(set(doc_ids))  # the passage ranking repeats a document: what the default must not do
    first_of = {}
    for p in passages:
        first_of.setdefault(p.metadata["doc_id"], p)
    hits = lc_retriever(tiny).invoke(MILL_QUESTION, k=len(first_of))
    assert [h.id for h in hits] == list(first_of)  # distinct documents, named by their own ids, in passage order
    for hit in hits:
        best = first_of[hit.id]
        assert hit.page_content == best.page_content
        assert without_timings(hit.metadata) == without_timings(best.metadata)
    assert [h.id for h in lc_retriever(tiny).invoke(MILL_QUESTION, k=2)] == list(first_of)[:2]


@pytest.mark.parametrize("method", ["endo", "bm25"])
def test_every_method_returns_distinct_documents_with_exact_offsets(tiny, method):
    hits = lc_retriever(tiny, method=method).invoke(MILL_QUESTION, k=2)
    assert len(hits) == 2 and hits[0].id != hits[1].id
    for hit in hits:
        assert hit.id == hit.metadata["doc_id"]
        source = TINY_TEXTS[int(hit.id[1:])]
        assert source[hit.metadata["char_start"]:hit.metadata["char_end"]] == hit.page_content


def test_llamaindex_hits_are_distinct_nodes_each_with_its_best_passage(tiny):
    from llama_index.core.schema import NodeRelationship

    passages = li_retriever(tiny, similarity_top_k=20, return_passages=True).retrieve(MILL_QUESTION)
    assert len({p.node.metadata["doc_id"] for p in passages}) < len(passages)
    first_of = {}
    for p in passages:
        first_of.setdefault(p.node.metadata["doc_id"], p)
    hits = li_retriever(tiny, similarity_top_k=3).retrieve(MILL_QUESTION)
    assert [h.node.node_id for h in hits] == list(first_of)[:3]
    for hit in hits:
        best, node = first_of[hit.node.node_id], hit.node
        assert (node.text, hit.score) == (best.node.text, best.score)
        assert (node.start_char_idx, node.end_char_idx) == (node.metadata["char_start"], node.metadata["char_end"])
        assert TINY_TEXTS[int(node.node_id[1:])][node.start_char_idx:node.end_char_idx] == node.text
        assert node.relationships[NodeRelationship.SOURCE].node_id == node.node_id
    assert any(":" in p.node.node_id for p in passages)  # a passage of a longer node has an id of its own


def test_each_document_gets_its_share_of_the_budget(tiny):
    budget, k = 40, 2
    hits = lc_retriever(tiny, budget=budget).invoke(MILL_QUESTION, k=k)
    assert len({h.id for h in hits}) == k
    assert all(tiny.count_tokens(h.page_content) <= budget // k + 2 for h in hits)  # ' ... ' joins may add a token
    assert any(len(h.page_content) < len(TINY_TEXTS[int(h.id[1:])]) for h in hits)  # the long one was cut


# ---- LangChain: filter operators, score thresholds, the chat model's settings ---------------------------------------
FILTERS = [  # filter -> the documents that match (topics mill, travel, science, food, travel; years as YEARS)
    ({"topic": "travel"}, {"d1", "d4"}),
    ({"topic": ["travel", "food"]}, {"d1", "d3", "d4"}),
    ({"topic": {"$eq": "science"}}, {"d2"}),
    ({"topic": {"$ne": "mill"}}, {"d1", "d2", "d3", "d4"}),
    ({"topic": {"$in": ["travel", "food"]}}, {"d1", "d3", "d4"}),
    ({"topic": {"$nin": ["travel"]}}, {"d0", "d2", "d3"}),
    ({"year": {"$gt": 1932}}, {"d2", "d3", "d4"}),
    ({"year": {"$gte": 1932}}, {"d1", "d2", "d3", "d4"}),
    ({"year": {"$lt": 1932}}, {"d0"}),
    ({"year": {"$lte": 1932}}, {"d0", "d1"}),
    ({"year": {"$gte": 1900, "$lt": 1980}}, {"d1", "d2"}),
    ({"topic": "travel", "year": 1988}, {"d4"}),
    ({"$and": [{"topic": "travel"}, {"year": {"$lt": 1950}}]}, {"d1"}),
    ({"$or": [{"topic": "mill"}, {"year": {"$gt": 2000}}]}, {"d0", "d3"}),
    ({"colour": {"$ne": "red"}}, {"d0", "d1", "d2", "d3", "d4"}),  # a missing key passes $ne and $nin only
    ({"colour": {"$in": ["red"]}}, set()),
    ({"topic": {"$gt": 5}}, set()),  # a string against a number matches nothing
]


def test_langchain_filters_take_the_operators_other_stores_take(tiny):
    retriever = lc_retriever(tiny)
    for filter, expected in FILTERS:
        assert {d.id for d in retriever.invoke(QUESTION, k=5, filter=filter)} == expected, filter
    assert {d.id for d in lc_retriever(tiny, filter={"year": {"$gt": 1932}}).invoke(QUESTION, k=5)} == \
        {"d2", "d3", "d4"}


@pytest.mark.parametrize("bad", [{"topic": {"$regex": "tr.*"}}, {"$not": {"topic": "mill"}},
                                 {"topic": {"$in": "travel"}}, {"$or": {"topic": "mill"}}, {"$and": []}, {},
                                 "topic == travel"], ids=str)
def test_langchain_filters_it_cannot_read_raise_a_clear_error(tiny, bad):
    retriever = lc_retriever(tiny)
    with pytest.raises(ValueError, match=r"\$in|operator|filter"):
        retriever.invoke(QUESTION, filter=bad)
    with pytest.raises(ValueError, match=r"\$in|operator|filter"):
        lc_retriever(tiny, filter=bad)


def test_langchain_score_threshold_drops_the_hits_below_it(tiny):
    retriever = lc_retriever(tiny)
    hits = retriever.invoke(QUESTION, k=5)
    scores = [h.metadata["endo_score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and scores[1] > scores[2]
    above = [h.id for h in hits[:2]]
    assert [h.id for h in retriever.invoke(QUESTION, k=5, score_threshold=scores[1])] == above
    assert [h.id for h in asyncio.run(retriever.ainvoke(QUESTION, k=5, score_threshold=scores[1]))] == above
    assert [h.id for h in lc_retriever(tiny, score_threshold=scores[1]).invoke(QUESTION, k=5)] == above


def test_langchain_reranker_writes_relevance_score_and_takes_a_threshold(tiny):
    pytest.importorskip("langchain_classic")
    from langchain_classic.retrievers import ContextualCompressionRetriever
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from langchain_endo import EndoReranker

    class FirstStage(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager=None):
            return [Document(page_content=t, id=f"d{i}") for i, t in enumerate(TINY_TEXTS[1:], 1)]

    def rerank(**kwargs):
        reranker = EndoReranker(top_n=4, backbone=tiny, **kwargs)
        return ContextualCompressionRetriever(base_compressor=reranker, base_retriever=FirstStage()).invoke(QUESTION)

    docs = rerank()
    scores = [d.metadata["relevance_score"] for d in docs]
    assert len(docs) == 4 and scores == sorted(scores, reverse=True) and scores[1] > scores[2]
    assert all("endo_score" not in d.metadata for d in docs)
    assert [d.id for d in rerank(score_threshold=scores[1])] == [d.id for d in docs[:2]]


def test_chat_model_samples_at_its_temperature_and_refuses_structured_output(tiny):
    import torch
    from pydantic import BaseModel

    from langchain_endo import ChatEndo

    greedy = ChatEndo(backbone=tiny, max_new_tokens=8).invoke("Name a colour.").content

    def sample(temperature, seed):
        torch.manual_seed(seed)
        return ChatEndo(backbone=tiny, max_new_tokens=8, temperature=temperature).invoke("Name a colour.").content

    assert sample(1.0, 0) == sample(1.0, 0)  # torch's seed repeats a sample
    assert any(sample(1.0, seed) != greedy for seed in range(3))  # a random model's flat logits: samples differ
    assert all(sample(1e-4, seed) == greedy for seed in range(3))  # near 0 the temperature leaves only the top token
    torch.manual_seed(0)
    assert ChatEndo(backbone=tiny, max_new_tokens=8).invoke("Name a colour.", temperature=1.0).content == \
        sample(1.0, 0)  # invoke's temperature overrides the model's
    with pytest.raises(ValueError, match="decodes greedily"):
        ChatEndo(backbone=tiny, temperature=0.7, attention="reattention")
    with pytest.raises(ValueError, match="temperature"):
        ChatEndo(backbone=tiny, temperature=-1)

    class Answer(BaseModel):
        colour: str

    with pytest.raises(NotImplementedError, match="no structured output"):
        ChatEndo(backbone=tiny).with_structured_output(Answer)


# ---- the reranker fuses with the first stage ------------------------------------------------------------------------
RERANK_TEXTS = TINY_TEXTS[1:]
FIRST_STAGE_SCORES = [0.9, 0.7, 0.6, 0.2]


def z(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return (x - x.mean()) / x.std()


def heads_of(backbone, texts, question) -> np.ndarray:
    """The heads' score per text, read best last as the reranker reads them."""
    from endo_retrieval.methods.heads import rank_passages

    return rank_passages(backbone, texts[::-1], question)[::-1]


@pytest.fixture
def li_first_stage():
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class FirstStage(BaseRetriever):
        """A vector store's answer, scored (or, with scores=None, ranked only)."""

        def __init__(self, scores):
            self.scores = scores
            super().__init__()

        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=t, id_=f"p{i}"), score=None if self.scores is None else s)
                    for i, (t, s) in enumerate(zip(RERANK_TEXTS, FIRST_STAGE_SCORES))]

    return FirstStage


def li_rerank(retriever, backbone, **kwargs):
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.postprocessor.endo import EndoReranker

    reranker = EndoReranker(top_n=len(RERANK_TEXTS), backbone=backbone, **kwargs)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(max_tokens=2), node_postprocessors=[reranker])
    return [(h.node.node_id, h.score) for h in engine.query(QUESTION).source_nodes]


def expected(scores) -> list[tuple[str, float]]:
    order = np.argsort(-scores, kind="stable")
    return [(f"p{i}", pytest.approx(float(scores[i]))) for i in order]


def test_llamaindex_reranker_fuses_standardised_first_stage_and_heads_scores(tiny, li_first_stage):
    heads = heads_of(tiny, RERANK_TEXTS, QUESTION)
    scored, ranked = li_first_stage(FIRST_STAGE_SCORES), li_first_stage(None)
    assert li_rerank(scored, tiny) == expected(0.5 * z(FIRST_STAGE_SCORES) + 0.5 * z(heads))
    assert li_rerank(ranked, tiny) == expected(0.5 * z(-np.arange(4)) + 0.5 * z(heads))  # no scores: ranks
    assert li_rerank(scored, tiny, fuse=False) == expected(heads)  # the heads alone
    w = {"first_stage": 0.8, "heads": 0.2}
    assert li_rerank(scored, tiny, weights=w) == expected(0.8 * z(FIRST_STAGE_SCORES) + 0.2 * z(heads))
    # the first stage alone keeps its order: the fusion can keep all the store had
    assert [i for i, _ in li_rerank(scored, tiny, weights={"first_stage": 1, "heads": 0})] == ["p0", "p1", "p2", "p3"]
    with pytest.raises(ValueError, match="first_stage"):
        li_rerank(scored, tiny, weights={"first": 1})


def test_reranker_weights_come_from_the_models_profile(tiny, tiny_profile, li_first_stage):
    from endo_retrieval.integrations import reranker_weights

    heads = heads_of(tiny, RERANK_TEXTS, QUESTION)
    profile = json.loads(tiny_profile.read_text())
    profile["reranker"] = {"minilm": {"first_stage": 0.3, "heads": 0.7}, "bge": {"first_stage": 0.9, "heads": 0.1}}
    tiny_profile.write_text(json.dumps(profile))
    assert reranker_weights(tiny, "bm25") == {"first_stage": 0.5, "heads": 0.5}  # not fitted: the default
    scored = li_first_stage(FIRST_STAGE_SCORES)
    assert li_rerank(scored, tiny) == expected(0.3 * z(FIRST_STAGE_SCORES) + 0.7 * z(heads))  # minilm's
    assert li_rerank(scored, tiny, first_stage="bge") == expected(0.9 * z(FIRST_STAGE_SCORES) + 0.1 * z(heads))
    with pytest.raises(ValueError, match="first stage 'vector'.*bge, bm25, minilm"):
        li_rerank(scored, tiny, first_stage="vector")
    profile["reranker"]["minilm"] = {"first_stage": "high"}
    tiny_profile.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="damaged"):
        li_rerank(scored, tiny)


def test_langchain_reranker_fuses_with_the_scores_or_ranks_in_the_documents(tiny):
    from langchain_core.documents import Document

    from langchain_endo import EndoReranker

    heads = heads_of(tiny, RERANK_TEXTS, QUESTION)

    def rerank(metadata, **kwargs):
        docs = [Document(page_content=t, id=f"p{i}", metadata=metadata(i)) for i, t in enumerate(RERANK_TEXTS)]
        out = EndoReranker(top_n=4, backbone=tiny, **kwargs).compress_documents(docs, QUESTION)
        return [(d.id, d.metadata["relevance_score"]) for d in out]

    with_scores = expected(0.5 * z(FIRST_STAGE_SCORES) + 0.5 * z(heads))
    assert rerank(lambda i: {"score": FIRST_STAGE_SCORES[i]}) == with_scores
    assert rerank(lambda i: {"relevance_score": FIRST_STAGE_SCORES[i], "score": 0}) == with_scores
    assert rerank(lambda i: {"mine": FIRST_STAGE_SCORES[i]}, score_key="mine") == with_scores
    assert rerank(lambda i: {}) == expected(0.5 * z(-np.arange(4)) + 0.5 * z(heads))  # no scores: ranks
    assert rerank(lambda i: {"score": FIRST_STAGE_SCORES[i]}, fuse=False) == expected(heads)
    with pytest.raises(ValueError, match="score_key='mine' is not in the metadata"):
        rerank(lambda i: {}, score_key="mine")
    with pytest.raises(ValueError, match="first_stage"):
        EndoReranker(backbone=tiny, weights={"first_stage": -1, "heads": 2})


def test_fit_reranker_section_reads_with_the_reranker_and_saves_into_the_profile(tiny, tiny_profile):
    from endo_retrieval.calibration.reranker import fit_reranker_section, save_reranker_entry
    from endo_retrieval.integrations import reranker_weights

    questions = [{"question": QUESTION, "candidates": RERANK_TEXTS, "first_stage_scores": FIRST_STAGE_SCORES,
                  "gold": [False, True, False, False]},
                 {"question": "Where is the Albatross based?", "candidates": RERANK_TEXTS, "first_stage_scores": None,
                  "gold": [False, False, False, True]}]
    entry = fit_reranker_section(tiny, questions, step=0.5)
    assert entry["first_stage"] in (0.0, 0.5, 1.0) and entry["first_stage"] + entry["heads"] == 1
    fit = entry["fit"]
    assert fit["n_questions"] == 2 and set(fit["recall"]) == {"@2", "@5", "@10"}
    assert fit["recall"]["@2"] + fit["recall"]["@5"] >= fit["first_stage_alone"]["@2"] + fit["first_stage_alone"]["@5"]
    assert fit["first_stage_alone"]["@2"] == 0.5  # question 1's gold is first-stage rank 2, question 2's rank 4
    save_reranker_entry(tiny, "bm25", entry)
    assert json.loads(tiny_profile.read_text())["reranker"]["bm25"] == entry
    assert reranker_weights(tiny, "bm25") == {"first_stage": entry["first_stage"], "heads": entry["heads"]}


# ---- the pipeline's knob: candidates read and tokens read of each ---------------------------------------------------
def test_depth_and_read_tokens_reach_the_pipeline_in_both_adapters_and_bad_ones_fail_when_built(tiny, tmp_path):
    from llama_index.retrievers.endo import EndoRetriever

    # the depth asked for is the first read; where its candidates hold fewer than k documents, deeper (k means k)
    assert len(li_retriever(tiny, similarity_top_k=4).retrieve(QUESTION)) == 4
    shallow = li_retriever(tiny, similarity_top_k=4, depth=2, read_tokens=16)
    depths, search = [], shallow.index.search
    shallow.index.search = lambda *args, **kw: depths.append(kw["depth"]) or search(*args, **kw)
    assert len(shallow.retrieve(QUESTION)) == 4 and depths[:2] == [2, 4]
    assert len(li_retriever(tiny, similarity_top_k=1, depth=2).retrieve(QUESTION)) == 1
    assert shallow.index.pipeline("endo", 2, 16).read_tokens == 16
    shallow.persist(tmp_path / "li")
    reloaded = EndoRetriever.from_persist_dir(tmp_path / "li", backbone=tiny)
    assert (reloaded.depth, reloaded.read_tokens) == (2, 16)
    assert len(lc_retriever(tiny, k=4).invoke(QUESTION)) == 4
    shallow = lc_retriever(tiny, k=1, depth=2)
    depths, search = [], shallow._index.search
    shallow._index.search = lambda *args, **kw: depths.append(kw["depth"]) or search(*args, **kw)
    assert len(shallow.invoke(QUESTION)) == 1 and depths == [2]
    for bad in ({"depth": 0}, {"read_tokens": 2}):
        with pytest.raises(ValueError, match="depth|read_tokens"):
            li_retriever(tiny, **bad)
        with pytest.raises(ValueError, match="depth|read_tokens"):
            lc_retriever(tiny, **bad)
    with pytest.raises(ValueError, match="tune the endo pipelines"):
        li_retriever(tiny, method="bm25", depth=5)
