"""The retrieval heads as a reranker after a first stage, on the real default model: LlamaIndex's EndoReranker
inside a RetrieverQueryEngine and LangChain's inside a ContextualCompressionRetriever. The first stage ranks the
passage that answers last (each answer passage is a longer text about a town that a vector store ranks below the
short on-topic ones); reranked by the heads alone (fuse=False) it must come first. (The fusion with the first stage
is checked on a tiny model in test_framework_conventions.py.) Plus the errors, and `endo bench rerank` on a made-up
HotpotQA file."""
from __future__ import annotations

import json

import numpy as np
import pytest

from endo_retrieval.integrations import RERANK_BEST_LAST, rerank_passages

CASES = {  # question -> passages in the first stage's order, the one that answers last
    "What is the home port of the research ship Albatross?": [
        "Research ships carry scientists to remote waters. Many research ships have their home port in Bremerhaven "
        "or Kiel.",
        "Every ship is registered at a home port, which is painted on its stern.",
        "The research ship Polarstern is based in Bremerhaven.",
        "Gdansk is a city on the Baltic coast of Poland. Its old town was rebuilt after the war, and its shipyard was "
        "the birthplace of the Solidarity movement. The research ship Albatross has been based in Gdansk since 1988.",
    ],
    "When was the Zephyr bridge painted green?": [
        "Bridges are often painted to protect the steel from rust. Green paint was popular for bridges in the 1930s.",
        "The Golden Gate bridge is painted in international orange. Painters work on it all year.",
        "When a bridge is painted, traffic is usually closed for several weeks.",
        "Varna is a town on a wide river with a market square and a Gothic church. Its fishermen sell eel and pike "
        "on the quay each morning. The Zephyr bridge was painted bright green in 1932 by the city council.",
    ],
}
NOT_A_MODEL = object()  # the errors are raised before the model is used


def heads_scores(backbone, passages: list[str], question: str) -> np.ndarray:
    """rank_passages on the passages in the order the adapters hand them to the model, mapped back."""
    from endo_retrieval.methods.heads import rank_passages

    if RERANK_BEST_LAST:
        return rank_passages(backbone, passages[::-1], question)[::-1]
    return rank_passages(backbone, passages, question)


# ---------------------------------------------------------------- LlamaIndex


@pytest.fixture
def llama_retriever():
    pytest.importorskip("llama_index.core")
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class FirstStage(BaseRetriever):
        """Returns the case's passages in its order, scored 1.0, 0.9, ...: the answer ranked last."""

        def _retrieve(self, query_bundle):
            passages = CASES[query_bundle.query_str]
            return [NodeWithScore(node=TextNode(text=t, id_=f"p{i}"), score=1.0 - i / 10)
                    for i, t in enumerate(passages)]

    return FirstStage()


@pytest.mark.slow
@pytest.mark.parametrize("question", sorted(CASES))
def test_llamaindex_query_engine_puts_the_answer_first(question, llama_retriever, backbone):
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.postprocessor.endo import EndoReranker

    reranker = EndoReranker(top_n=2, backbone=backbone, fuse=False)
    engine = RetrieverQueryEngine.from_args(llama_retriever, llm=MockLLM(max_tokens=4), node_postprocessors=[reranker])
    hits = engine.query(question).source_nodes
    last = len(CASES[question]) - 1
    assert [h.node.node_id for h in hits][0] == f"p{last}" and len(hits) == 2
    expected = heads_scores(backbone, CASES[question], question)
    order = np.argsort(-expected, kind="stable")[:2]
    assert [h.node.node_id for h in hits] == [f"p{i}" for i in order]
    assert [h.score for h in hits] == pytest.approx(expected[order].tolist())  # the heads' scores, not the first's
    assert EndoReranker()._backbone is backbone  # backbone=None: the shared default model


def test_llamaindex_errors():
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.endo import EndoReranker

    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ValueError, match="top_n"):
            EndoReranker(top_n=bad, backbone=NOT_A_MODEL)
    reranker = EndoReranker(backbone=NOT_A_MODEL)
    nodes = [NodeWithScore(node=TextNode(text="Some text."), score=1.0)]
    with pytest.raises(ValueError, match="needs the query"):
        reranker.postprocess_nodes(nodes)
    with pytest.raises(ValueError, match="needs the question"):
        reranker.postprocess_nodes(nodes, query_str="   ")
    assert reranker.postprocess_nodes([], query_str="Anything?") == []
    assert reranker.top_n == 5 and EndoReranker.class_name() == "EndoReranker"


# ---------------------------------------------------------------- LangChain


@pytest.fixture
def langchain_retriever():
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class FirstStage(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager=None):
            return [Document(page_content=t, id=f"p{i}", metadata={"rank": i}) for i, t in enumerate(CASES[query])]

    return FirstStage()


@pytest.mark.slow
@pytest.mark.parametrize("question", sorted(CASES))
def test_langchain_compression_retriever_puts_the_answer_first(question, langchain_retriever, backbone):
    pytest.importorskip("langchain_classic")
    from langchain_classic.retrievers import ContextualCompressionRetriever

    from langchain_endo import EndoReranker

    pipeline = ContextualCompressionRetriever(base_compressor=EndoReranker(top_n=3, backbone=backbone, fuse=False),
                                              base_retriever=langchain_retriever)
    docs = pipeline.invoke(question)
    last = len(CASES[question]) - 1
    assert len(docs) == 3 and docs[0].id == f"p{last}" and docs[0].metadata["rank"] == last
    expected = heads_scores(backbone, CASES[question], question)
    assert [d.metadata["relevance_score"] for d in docs] == pytest.approx(sorted(expected, reverse=True)[:3])
    assert all(d.page_content == CASES[question][d.metadata["rank"]] for d in docs)


def test_langchain_errors():
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document

    from langchain_endo import EndoReranker

    for bad in (0, -2, 1.5, "3"):
        with pytest.raises(ValueError, match="top_n"):
            EndoReranker(top_n=bad)
    reranker = EndoReranker(backbone=NOT_A_MODEL)
    assert reranker.top_n == 5
    with pytest.raises(ValueError, match="needs the question"):
        reranker.compress_documents([Document(page_content="Some text.")], "")
    assert reranker.compress_documents([], "Anything?") == []
    with pytest.raises(ValueError, match="top_n"):
        rerank_passages(["Some text."], "Anything?", 0, NOT_A_MODEL)


# ---------------------------------------------------------------- endo bench rerank


def made_up_hotpotqa(path):
    def item(i, question, gold):
        filler = [[f"Filler {i}-{j}", [f"Paragraph {j} of item {i} is about the weather.", "It rained."]]
                  for j in range(2)]
        return {"_id": f"toy{i}", "question": question, "answer": "x", "type": "bridge", "level": "hard",
                "supporting_facts": [[t, k] for t, sentences in gold for k in range(len(sentences))],
                "context": [*gold, *filler]}

    items = [
        item(0, "Which river flows through Zanthor?", [["Zanthor", ["Zanthor is a city on the Velna river."]],
                                                        ["Velna", ["The Velna rises in the Kesh hills."]]]),
        item(1, "Who founded the Orrin Guild?", [["Orrin Guild", ["The Orrin Guild was founded by Mara Tesk."]],
                                                 ["Mara Tesk", ["Mara Tesk was a weaver.", "She lived in Lund."]]]),
        item(2, "What colour is the Zephyr bridge?", [["Zephyr bridge", ["The Zephyr bridge is painted green."]],
                                                      ["Zanthor", ["Zanthor is a city on the Velna river."]]]),
    ]
    path.write_text(json.dumps(items))
    return path  # 12 paragraphs, Zanthor twice and kept once: 11; 2 + 3 + 2 = 7 gold sentences


def test_bench_counts_gold_sentences_by_their_paragraph(tmp_path):
    from endo_retrieval.calibration.datasets import DataError
    from endo_bench.rerank import found, hotpotqa_corpus

    titles, texts, items = hotpotqa_corpus(made_up_hotpotqa(tmp_path / "toy.json"))
    assert len(titles) == len(set(titles)) == 11 and texts[titles.index("Mara Tesk")] == \
        "Mara Tesk: Mara Tesk was a weaver. She lived in Lund."
    assert [found(["Mara Tesk", "Filler 1-0"], it) for it in items] == [(0, 2), (2, 3), (0, 2)]
    (tmp_path / "bad.json").write_text(json.dumps([{"_id": "a", "question": "q", "answer": "a", "context": 3}]))
    with pytest.raises(DataError, match="item 0"):
        hotpotqa_corpus(tmp_path / "bad.json")


@pytest.mark.slow
def test_bench_rerank_writes_rows_and_table(tmp_path, backbone):
    pytest.importorskip("sentence_transformers")
    from endo_retrieval.cli import main

    out = tmp_path / "rerank.json"
    assert main(["bench", "rerank", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--top", "2", "--candidates", "2,11", "--order", "best-last", "first-stage"]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "endo-bench-rerank/1" and result["config"]["corpus_paragraphs"] == 11
    rows = result["rows"]
    assert [(r["system"], r["candidates"], r["order"]) for r in rows] == [
        ("vector", 2, None), ("vector+rerank", 2, "best-last"), ("vector+rerank", 2, "first-stage"),
        ("vector+rerank", 11, "best-last"), ("vector+rerank", 11, "first-stage")]
    assert all(r["n"] == 3 and r["n_gold"] == 7 and 0 <= r["gold_found"] <= 7 and 0 <= r["recall"] <= 1
               for r in rows)
    for r in rows[1:3]:  # reranking the top 2 and keeping 2 keeps the vector store's own set
        assert (r["gold_found"], r["recall"]) == (rows[0]["gold_found"], rows[0]["recall"])
        assert r["latency_ms"]["mean"] > rows[0]["latency_ms"]["mean"]  # the reranker's forward on top
    table = out.with_suffix(".md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| vector | 2 | - |")
    assert main(["bench", "rerank", "--data", str(tmp_path / "toy.json"), "--out", str(out), "--top", "3",
                 "--candidates", "2"]) == 2  # fewer candidates than kept passages


# ---------------------------------------------------------------- candidates longer than the window


def test_water_level_gives_the_long_passages_what_the_short_ones_leave():
    from endo_retrieval.integrations import water_level

    assert water_level(np.array([10, 100, 100]), 150) == 70  # 10 whole, then (150 - 10) // 2 each
    assert water_level(np.array([10, 20, 30]), 1000) == 30  # everything fits: the longest
    assert water_level(np.array([50, 50, 50, 50]), 100) == 25
    lengths = np.array([3, 90, 41, 7, 300, 12])
    for room in (30, 100, 200, 400):
        s = water_level(lengths, room)
        assert np.minimum(lengths, s).sum() <= room < np.minimum(lengths, s + 1).sum()  # the largest such share


FILLER = ("The orchard in the {n}th valley grows apples, pears and plums for the market in the town below. "
          "Its farmers bring the harvest down on carts every autumn, and the cider press runs for weeks. ")


def long_candidates(n: int = 24, repeats: int = 14) -> list[str]:
    """n passages of ~400 tokens each about orchards, one of which buries the answer in its middle."""
    out = [" ".join(FILLER.format(n=i + 1) for _ in range(repeats)) for i in range(n)]
    half = FILLER.format(n=7) * (repeats // 2)
    out[5] = half + "The research ship Albatross has been based in Gdansk since 1988. " + half
    return out


@pytest.mark.slow
def test_fit_to_window_cuts_each_long_passage_to_its_best_part_and_drops_none(backbone):
    from endo_retrieval.integrations import fit_to_window

    question = "What is the home port of the research ship Albatross?"
    short = "Gdansk is a port on the Baltic coast."
    passages = long_candidates(6) + [short]
    assert fit_to_window(backbone, passages, question, window=100_000) == passages  # fits: read whole
    read = fit_to_window(backbone, passages, question, window=600)
    assert len(read) == len(passages) and read[-1] == short  # none dropped; the short one whole
    lengths = [len(backbone.encode(t)) for t in read]
    assert sum(lengths) <= 600 + 3 * len(passages)  # ' ... ' joins may re-tokenise a little longer
    assert "Albatross has been based in Gdansk" in read[5]  # the sentence with the question's words is kept
    assert all(t.startswith("The orchard in the") for t in read[:6])  # each keeps its first sentence
    with pytest.raises(ValueError, match="fewer candidates"):
        fit_to_window(backbone, passages, question, window=60)


@pytest.mark.slow
def test_llamaindex_reranker_over_candidates_longer_than_the_window(backbone, monkeypatch):
    """~10k tokens of candidates, more than the model's 8k window: the model reads at most its window, every node
    is scored (none dropped), each comes back whole, and the one that answers comes first."""
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.endo import EndoReranker

    import endo_retrieval.methods.heads as heads

    read = []
    rank = heads.rank_passages
    monkeypatch.setattr(heads, "rank_passages", lambda b, texts, q: read.append(texts) or rank(b, texts, q))
    passages = long_candidates()
    assert sum(len(backbone.encode(t)) for t in passages) > backbone.max_position
    nodes = [NodeWithScore(node=TextNode(text=t, id_=f"p{i}"), score=1.0) for i, t in enumerate(passages)]
    kept = EndoReranker(top_n=len(nodes), backbone=backbone).postprocess_nodes(
        nodes, query_str="What is the home port of the research ship Albatross?")
    assert sorted(k.node.node_id for k in kept) == sorted(n.node.node_id for n in nodes)
    assert all(k.node.get_content() == passages[int(k.node.node_id[1:])] for k in kept)
    assert kept[0].node.node_id == "p5"
    assert len(read[0]) == len(passages) and sum(len(backbone.encode(t)) for t in read[0]) < backbone.max_position


def test_minilm_embedding_is_the_dense_stages_own_and_serves_a_vector_store():
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.postprocessor.endo import MiniLMEmbedding

    from endo_retrieval.index.dense import EmbedderError, embed

    model = MiniLMEmbedding()
    texts = ["The Zephyr bridge crosses the Varna river.", "A small feline slept on the rug."]
    np.testing.assert_allclose(model.get_text_embedding_batch(texts), embed("all-MiniLM-L6-v2", texts), atol=1e-6)
    retriever = VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=model).as_retriever(
        similarity_top_k=1)
    assert "feline" in retriever.retrieve("Where did a cat nap?")[0].node.get_content()
    with pytest.raises(EmbedderError, match="Cannot load the embedder"):
        MiniLMEmbedding(model_name="/no/such/model")
