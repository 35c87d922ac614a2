"""The default `endo` pipeline over a corpus: passages, what the model reads of them, the fused ranking, the one
default of every entry point, and a real query engine and chain on HotpotQA where it beats BM25 alone."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.methods import DEFAULT_METHOD
from endo_retrieval.index.passages import Passages, best_part, passage_cuts
from conftest import shared_data


def corpus_of(docs: dict[str, str], tokens_per_char: int = 1) -> CorpusMap:
    """A corpus map whose tokens are single characters (offsets known by hand)."""
    corpus = CorpusMap()
    for doc_id, text in docs.items():
        corpus.add_document(doc_id, text, np.array([[i, i + 1] for i in range(len(text))]))
    return corpus


def test_passage_cuts_keep_whole_sentences_up_to_the_limit():
    starts = np.array([0, 10, 25, 30, 70])
    assert passage_cuts(starts, 80, 100) == [0, 80]  # short: the document is one passage
    assert passage_cuts(starts, 80, 30) == [0, 30, 60, 80]  # 0-30 holds three sentences; 30-70 is longer: cut
    assert passage_cuts(np.array([0]), 50, 20) == [0, 20, 40, 50]  # one sentence past the limit is cut


def test_best_part_keeps_the_first_sentence_then_those_with_question_words():
    text = "Alpha is a town. Rain fell. The mill makes flour. Beta river flows."
    corpus = corpus_of({"d": text})
    sentences = corpus.sentence_starts()
    first_end = text.index("Rain")
    mill = text.index("The mill"), text.index("Beta")
    assert best_part(corpus, sentences, 0, len(text), {"flour"}, len(text)) == [(0, len(text))]  # all fits
    parts = best_part(corpus, sentences, 0, len(text), {"flour", "mill"}, first_end + mill[1] - mill[0])
    assert parts == [(0, first_end), mill]  # the lead, then the sentence with the question's words, in order
    assert best_part(corpus, sentences, 0, len(text), {"nothing"}, 30) == [(0, first_end)]  # no word: the lead
    assert best_part(corpus, sentences, 0, len(text), {"flour"}, 5) == [(0, 5)]  # a lead past the limit is cut


def test_passages_are_scored_by_bm25_over_their_words():
    corpus = corpus_of({"a": "The quartz mine. It is deep.", "b": "A river flows by the town.", "c": "Rain."})
    passages = Passages.build(corpus)
    assert len(passages) == 3 and list(passages.starts) == [0, corpus.doc("b").start, corpus.doc("c").start]
    scores = passages.bm25.get_scores(["quartz"])
    assert scores[0] > 0 == scores[1] == scores[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_model

    from endo_retrieval import Backbone

    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("pipeline")), device="cpu")


def test_batched_reads_rank_as_the_plain_reads_in_two_forwards_a_question(tiny):
    """The pipeline with its query parts read together against its plain twin (one forward per part): the same
    passages in the same order, the same scores to float tolerance, 2 forwards a question where there were 5, and
    the model's stages timed beside its whole part."""
    from endo_retrieval.methods.pipeline import EndoPipeline

    docs = {f"d{i}": t for i, t in enumerate([
        "The Varna bridge was built in 1871. Workers found quartz under its piers.",
        "The Varna river floods every spring. Farmers plant rice on its banks.",
        "Quartz is a hard mineral made of silicon and oxygen.",
        "The town hall of Varna has a clock tower. Its bell was cast in Vienna.",
        "A mill on the river grinds wheat. The miller sells flour in Varna."])}
    corpus = CorpusMap()
    for doc_id, text in docs.items():
        corpus.add_document(doc_id, text, tiny.encode(text).offsets)
    passages = Passages.build(corpus)
    count = [0]
    handle = tiny.model.model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    hits, forwards = {}, {}
    try:
        for batched in (False, True):
            pipe = EndoPipeline(tiny, heads=[(1, 0), (2, 3), (3, 1)], batched_reads=batched,
                                weights={"bm25": 0.4, "heads": 0.4, "hop2": 0.2})
            count[0] = 0
            hits[batched] = pipe.passage_hits(corpus, passages, "Which mineral was found under the Varna bridge?", k=5)
            forwards[batched] = count[0]
    finally:
        handle.remove()
    assert forwards == {False: 5, True: 2}
    assert [h.doc_id for h in hits[True]] == [h.doc_id for h in hits[False]] and len(hits[True]) == 5
    for mine, theirs in zip(hits[True], hits[False]):
        assert mine.score == pytest.approx(theirs.score, rel=1e-4, abs=1e-6)  # standardised: spreads amplify
        for name in ("bm25", "heads", "hop2"):
            assert mine.stage_scores[name] == pytest.approx(theirs.stage_scores[name], rel=1e-4, abs=1e-6)
    ms = hits[True][0].stage_ms
    assert {"read", "question", "hop2"} <= set(ms) and sum(ms[s] for s in ("read", "question", "hop2")) <= ms["heads"]


def test_every_entry_point_defaults_to_the_one_constant():
    from langchain_endo import EndoDocumentCompressor, EndoRetriever as LCRetriever
    from llama_index.postprocessor.endo import EndoCompressor
    from llama_index.retrievers.endo import EndoRetriever

    from endo_retrieval import EndoIndex, compress
    from endo_retrieval.cli import build_parser
    from endo_retrieval.integrations import compress_passages
    from endo_retrieval.cli.mcp_server import add_arguments

    assert DEFAULT_METHOD == "endo"
    for fn in (compress, compress_passages, EndoIndex.__init__, EndoRetriever.__init__, EndoRetriever.from_defaults,
               EndoCompressor.__init__):
        assert inspect.signature(fn).parameters["method"].default == DEFAULT_METHOD, fn
    for model in (LCRetriever, EndoDocumentCompressor):
        assert model.model_fields["method"].default == DEFAULT_METHOD, model
    import argparse

    assert add_arguments(argparse.ArgumentParser()).parse_args([]).method == DEFAULT_METHOD
    parser = build_parser()
    assert parser.parse_args(["index", "x", "--out", "y"]).method == DEFAULT_METHOD
    assert parser.parse_args(["compress", "--context", "x", "--question", "q"]).method == DEFAULT_METHOD


@pytest.mark.slow
def test_the_pipeline_ranks_passages_with_fused_scores_and_refuses_what_the_index_cannot_serve(backbone):
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.endo import EndoRetriever

    from endo_retrieval import EndoIndex

    index = EndoIndex(backbone)  # the default: endo, no SAE pass, so no feature postings
    assert index.methods == ("endo", "endo-2hop", "bm25")
    with pytest.raises(ValueError, match="cannot search with 's3-hybrid'; it searches with endo, endo-2hop, bm25"):
        EndoRetriever(index, method="s3-hybrid")
    nodes = [TextNode(id_=f"n{i}", text=t) for i, t in enumerate([
        "The Varna bridge was built in 1871. Workers found quartz under its piers.",
        "The Varna river floods every spring. Farmers plant rice on its banks.",
        "Quartz is a hard mineral made of silicon and oxygen.",
        "The town hall of Varna has a clock tower. Its bell was cast in Vienna.",
    ])]
    # the GPU's setting (20 candidates), whose fusion weighs the second hop (a CPU's own leaves it out)
    retriever = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=3, depth=20)
    hits = retriever.retrieve("Which mineral was found under the Varna bridge?")
    assert len(hits) == 3 and len({h.node.metadata["doc_id"] for h in hits}) == 3
    assert hits[0].node.metadata["doc_id"] == "n0"
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    for h in hits:  # the fused score is the node's score; each stage's score and time ride along
        stages = h.node.metadata["endo_stage_scores"]
        assert set(stages) == {"bm25", "dense", "heads", "hop2", "fused"} and stages["fused"] == pytest.approx(h.score)
        assert h.node.metadata["endo_stage_ms"]["total"] > 0
        assert "endo_stage_scores" in h.node.excluded_llm_metadata_keys
        source = nodes[int(h.node.metadata["doc_id"][1:])].text
        assert source[h.node.start_char_idx:h.node.end_char_idx] == h.node.text
    short = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=2, budget=12).retrieve("Varna bridge quartz")
    assert sum(backbone.count_tokens(h.node.text) for h in short) <= 14  # each cut to its best part of 12 // 2


@pytest.mark.slow
def test_default_retrieves_both_gold_paragraphs_where_bm25_does_not_in_a_query_engine_and_a_chain():
    """dev300's question 6 over the paragraphs of its first 30 questions (known by hand): the fused default puts
    both gold paragraphs first; BM25 alone ranks a 'Sacred Heart High School' paragraph above one of them."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import TextNode
    from llama_index.llms.endo import EndoLLM
    from llama_index.retrievers.endo import EndoRetriever

    from endo_retrieval.calibration.datasets import hotpotqa_corpus
    from langchain_endo import ChatEndo, EndoRetriever as LCRetriever

    titles, paragraphs, items = hotpotqa_corpus(shared_data("hotpotqa", "dev300.json"))
    own = {t for item in items[:30] for t, _ in item["context"]}
    nodes = [TextNode(id_=t, text=p) for t, p in zip(titles, paragraphs) if t in own]
    question = items[6]["question"]
    gold = {"High School (1968 film)", "The Thorn in the Heart"}
    assert {t for t, _ in items[6]["supporting_facts"]} == gold

    bm25 = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=2, method="bm25")
    assert {n.node.metadata["doc_id"] for n in bm25.retrieve(question)} != gold
    engine = RetrieverQueryEngine.from_args(EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=2),
                                            llm=EndoLLM(max_new_tokens=8))
    response = engine.query(question)
    assert {n.node.metadata["doc_id"] for n in response.source_nodes} == gold
    assert str(response).strip()

    retriever = LCRetriever(documents=[_lc_document(n) for n in nodes], k=2)
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}")
    chain = RunnablePassthrough.assign(docs=lambda x: retriever.invoke(x["question"])) | RunnablePassthrough.assign(
        answer=lambda x: (prompt | ChatEndo(max_new_tokens=8) | StrOutputParser()).invoke(
            {"context": "\n\n".join(d.page_content for d in x["docs"]), "question": x["question"]}))
    out = chain.invoke({"question": question})
    assert {d.metadata["doc_id"] for d in out["docs"]} == gold and out["answer"].strip()


def _lc_document(node):
    from langchain_core.documents import Document

    return Document(page_content=node.text, id=node.node_id)


@pytest.mark.slow
def test_the_command_line_indexes_for_the_pipeline_and_answers_with_its_stage_scores(tmp_path, capsys):
    import json

    from endo_retrieval.cli import main

    notes = tmp_path / "notes"
    notes.mkdir()
    for name, text in {"bridge.txt": "Workers found quartz under the Varna bridge in 1871.",
                       "river.txt": "The Varna river floods every spring.", "bell.txt": "The bell was cast in Vienna."
                       }.items():
        (notes / name).write_text(text)
    assert main(["index", str(notes), "--out", str(tmp_path / "ix")]) == 0
    summary = capsys.readouterr().out
    assert "(method endo)" in summary and "postings" not in summary  # the default pipeline's index only tokenises
    question = "Which mineral was found under the bridge?"
    assert main(["query", str(tmp_path / "ix"), question, "--k", "2", "--json", "--depth", "20"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert Path(hits[0]["doc_id"]).name == "bridge.txt" and hits[0]["score"] >= hits[1]["score"]
    # the GPU's setting weighs the hop
    assert set(hits[0]["stage_scores"]) == {"bm25", "dense", "heads", "hop2", "fused"}
    assert main(["query", str(tmp_path / "ix"), question, "--k", "2", "--json"]) == 0
    # this CPU's own setting leaves it out
    assert set(json.loads(capsys.readouterr().out)[0]["stage_scores"]) == {"bm25", "dense", "heads", "fused"}
    assert main(["query", str(tmp_path / "ix"), "bridge", "--method", "s3"]) == 2
    assert "cannot search with 's3'" in capsys.readouterr().err


@pytest.mark.slow
def test_metadata_filters_in_both_frameworks_never_return_a_filtered_out_node(backbone):
    from langchain_core.documents import Document as LCDocument
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters
    from llama_index.llms.endo import EndoLLM
    from llama_index.retrievers.endo import EndoRetriever, metadata_predicate

    from langchain_endo import EndoRetriever as LCRetriever

    texts = {"a": ("Quartz was found under the Varna bridge.", {"year": 2020, "kind": "report"}),
             "b": ("Quartz is a mineral found in granite near Varna.", {"year": 2010, "kind": "book"}),
             "c": ("The Varna bridge is old.", {"year": 2021, "kind": "report"})}
    nodes = [TextNode(id_=k, text=t, metadata=m) for k, (t, m) in texts.items()]
    question = "Which mineral was found under the Varna bridge?"
    recent = MetadataFilters(filters=[MetadataFilter(key="year", value=2015, operator=FilterOperator.GTE)])
    retriever = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=3, filters=recent)
    assert [n.node.metadata["doc_id"] for n in retriever.retrieve(question)] == ["a", "c"]  # k=3, only 2 match
    response = RetrieverQueryEngine.from_args(retriever, llm=EndoLLM(max_new_tokens=4)).query(question)
    assert {n.node.metadata["doc_id"] for n in response.source_nodes} <= {"a", "c"}
    retriever.filters = MetadataFilters(filters=[MetadataFilter(key="kind", value="book"),
                                                 MetadataFilter(key="year", value=2021)], condition="or")
    assert sorted(n.node.metadata["doc_id"] for n in retriever.retrieve(question)) == ["b", "c"]
    assert metadata_predicate(MetadataFilters(filters=[MetadataFilter(key="year", value="x", operator="<")]))(
        {"year": 2020}) is False  # incomparable values: no match, no error
    nowhere = MetadataFilters(filters=[MetadataFilter(key="kind", value=["memo"], operator=FilterOperator.IN)])
    assert EndoRetriever.from_defaults(nodes=nodes, filters=nowhere).retrieve(question) == []

    lc = LCRetriever(documents=[LCDocument(page_content=t, metadata=m, id=k) for k, (t, m) in texts.items()], k=3)
    assert [d.metadata["doc_id"] for d in lc.invoke(question, filter={"kind": "report"})] == ["a", "c"]
    assert sorted(d.metadata["doc_id"] for d in lc.invoke(question, filter={"year": [2010, 2021]})) == ["b", "c"]
    with pytest.raises(ValueError, match="Cannot read the filter"):
        lc.invoke(question, filter="kind=report")


@pytest.mark.slow
def test_insert_and_delete_without_a_rebuild_then_persist_and_reload(tmp_path):
    from langchain_core.documents import Document as LCDocument
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.retrievers.endo import EndoRetriever

    from langchain_endo import EndoRetriever as LCRetriever

    question = "Which mineral was found under the Varna bridge?"
    retriever = EndoRetriever.from_defaults(nodes=[Document(id_="river", text="The Varna river floods in spring.")],
                                            similarity_top_k=3)
    report = Document(id_="report", text="Quartz was found under the Varna bridge. The bridge dates from 1871.")
    nodes = SentenceSplitter(chunk_size=16, chunk_overlap=0).get_nodes_from_documents([report])
    assert len(nodes) == 2 and {n.ref_doc_id for n in nodes} == {"report"}
    retriever.insert(nodes)
    hits = retriever.retrieve(question)
    assert hits[0].node.text.startswith("Quartz") and "ref_doc_id" in hits[0].node.excluded_llm_metadata_keys
    retriever.delete_ref_doc("report")  # both of its nodes go
    assert [h.node.metadata["doc_id"] for h in retriever.retrieve(question)] == ["river"]
    with pytest.raises(ValueError, match="report"):  # already gone: LlamaIndex's strict delete raises
        retriever.delete_ref_doc("report", raise_error=True)
    retriever.delete_ref_doc("report")  # by default, as LlamaIndex's indexes: a warning, nothing deleted
    retriever.persist(tmp_path / "li")
    assert len(EndoRetriever.from_persist_dir(tmp_path / "li").index) == 1

    lc = LCRetriever(texts=["The Varna river floods in spring."], k=3)
    ids = lc.add_documents([LCDocument(page_content="Quartz was found under the Varna bridge.", metadata={"n": 1}),
                            LCDocument(page_content="The bell was cast in Vienna.", id="bell")])
    assert ids[1] == "bell" and len(set(ids) | {"doc-0"}) == 3
    assert lc.invoke(question)[0].metadata["doc_id"] == ids[0]
    assert lc.delete(["nope"]) is False and len(lc.index) == 3  # unknown ids: nothing to delete
    assert lc.delete([ids[0], "nope"]) is True  # as LangChain's stores: the known one goes
    lc.save(tmp_path / "lc")
    reloaded = LCRetriever(index_dir=tmp_path / "lc", k=3)
    assert sorted(reloaded.index.doc_ids) == ["bell", "doc-0"]
    assert ids[0] not in {d.metadata["doc_id"] for d in reloaded.invoke(question)}


def test_bm25_terms_for_scripts_written_without_spaces():
    from endo_retrieval.scoring.bm25 import words

    assert words("Le café naïf, the BRIDGE") == ["le", "café", "naïf", "bridge"]
    assert words("桥下发现石英") == ["桥", "下", "发", "现", "石", "英", "桥下", "下发", "发现", "现石", "石英"]
    assert words("abc中文") == ["abc", "中", "文", "中文"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["endo", "bm25"])
def test_french_and_chinese_are_indexed_and_retrieved_with_exact_offsets(method):
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.endo import EndoRetriever

    texts = {
        "fr-pont": "Le pont de Varna fut construit en 1871. Les ouvriers trouvèrent du quartz sous ses piles.",
        "fr-riviere": "La rivière Varna déborde chaque printemps. Les paysans cultivent du riz sur ses rives.",
        "zh-bridge": "瓦尔纳桥建于一八七一年。工人们在桥墩下发现了石英。",
        "zh-river": "瓦尔纳河每年春天泛滥。农民在河岸上种植水稻。",
    }
    retriever = EndoRetriever.from_defaults(nodes=[TextNode(id_=k, text=v) for k, v in texts.items()],
                                            similarity_top_k=2, method=method)
    for question, gold, piece in (("Qu'ont trouvé les ouvriers sous le pont ?", "fr-pont", "quartz"),
                                  ("工人们在桥墩下发现了什么？", "zh-bridge", "石英")):
        hits = retriever.retrieve(question)
        assert hits[0].node.metadata["doc_id"] == gold and piece in hits[0].node.text
        for h in hits:
            source = texts[h.node.metadata["doc_id"]]
            assert source[h.node.metadata["char_start"]:h.node.metadata["char_end"]] == h.node.text


@pytest.mark.slow
def test_llamaindex_retriever_evaluator_scores_the_default_retriever_on_a_dev300_slice():
    import asyncio

    from llama_index.core.evaluation import RetrieverEvaluator
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.endo import EndoRetriever

    from endo_retrieval.calibration.datasets import hotpotqa_corpus

    titles, paragraphs, items = hotpotqa_corpus(shared_data("hotpotqa", "dev300.json"))
    own = {t for item in items[:20] for t, _ in item["context"]}
    retriever = EndoRetriever.from_defaults(nodes=[TextNode(id_=t, text=p) for t, p in zip(titles, paragraphs)
                                                   if t in own], similarity_top_k=2)
    evaluator = RetrieverEvaluator.from_metric_names(["hit_rate", "mrr"], retriever=retriever)
    for item in items[:5]:
        expected = sorted({t for t, _ in item["supporting_facts"]})
        result = asyncio.run(evaluator.aevaluate(item["question"], expected_ids=expected))
        ranked = [n.node.node_id for n in retriever.retrieve(item["question"])]  # whole paragraphs keep their ids
        first = next((i for i, n in enumerate(ranked) if n in expected), None)
        assert result.metric_vals_dict["hit_rate"] == float(first is not None)
        assert result.metric_vals_dict["mrr"] == pytest.approx(0.0 if first is None else 1 / (first + 1))


@pytest.mark.slow
def test_a_similarity_cutoff_thresholds_the_fused_score_in_a_query_engine():
    from llama_index.core.postprocessor import SimilarityPostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import TextNode
    from llama_index.llms.endo import EndoLLM
    from llama_index.retrievers.endo import EndoRetriever

    nodes = [TextNode(id_=f"n{i}", text=t) for i, t in enumerate([
        "Workers found quartz under the Varna bridge in 1871.", "The Varna river floods every spring.",
        "Quartz is a hard mineral.", "The bell of the town hall was cast in Vienna."])]
    retriever = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=4)
    question = "Which mineral was found under the Varna bridge?"
    hits = retriever.retrieve(question)
    # the fused score is a weighted sum of scores standardised over the candidates: the candidates' mean is 0
    assert sum(h.score for h in hits) == pytest.approx(0.0, abs=1e-6)
    engine = RetrieverQueryEngine.from_args(retriever, llm=EndoLLM(max_new_tokens=4),
                                            node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=0.0)])
    kept = engine.query(question).source_nodes
    assert [n.node.node_id for n in kept] == [h.node.node_id for h in hits if h.score >= 0.0]
    assert 0 < len(kept) < len(hits)


@pytest.mark.slow
def test_traces_record_the_retrieval_and_its_stage_timings_in_both_frameworks():
    from langchain_core.callbacks import BaseCallbackHandler
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.endo import EndoRetrievalStages, EndoRetriever

    from langchain_endo import EndoRetriever as LCRetriever

    texts = ["Workers found quartz under the Varna bridge.", "The Varna river floods every spring."]
    question = "Which mineral was found under the bridge?"

    class Events(BaseEventHandler):
        seen: list = []

        def handle(self, event, **kwargs) -> None:
            self.seen.append(event)

    root, events, spans = get_dispatcher(), Events(), SimpleSpanHandler()
    root.add_event_handler(events)
    root.add_span_handler(spans)
    try:
        EndoRetriever.from_defaults(nodes=[TextNode(text=t) for t in texts], similarity_top_k=1).retrieve(question)
    finally:
        root.event_handlers.remove(events)
        root.span_handlers.remove(spans)
    stages = [e for e in events.seen if isinstance(e, EndoRetrievalStages)]
    assert len(stages) == 1 and stages[0].method == "endo" and stages[0].stage_ms["heads"] > 0
    retrieval = {s.id_ for s in spans.completed_spans if s.id_.startswith("EndoRetriever.")}
    assert {i.split("-")[0] for i in retrieval} == {"EndoRetriever.retrieve", "EndoRetriever._retrieve"}
    assert stages[0].span_id in retrieval  # the event sits inside the retrieval's span

    class Callbacks(BaseCallbackHandler):
        documents: list = []

        def on_retriever_end(self, documents, **kwargs) -> None:
            self.documents.extend(documents)

    handler = Callbacks()
    LCRetriever(texts=texts, k=1).invoke(question, config={"callbacks": [handler]})
    assert len(handler.documents) == 1 and handler.documents[0].metadata["endo_stage_ms"]["heads"] > 0


def test_a_setting_reads_with_the_weights_fitted_for_it_and_a_cpu_with_its_own_setting():
    from endo_retrieval.methods.pipeline import fitted_setting, fitted_weights

    row = lambda d, order, w: {"depth": d, "read_tokens": 128, "order": order, "weights": w}  # noqa: E731
    section = {"depth": 20, "read_tokens": 128, "best_last": True, "weights": {"bm25": 0.4, "heads": 0.6},
               "cpu": {"depth": 14, "fit": {"table": [row(14, "best-last", {"bm25": 0.1, "heads": 0.9})]}},
               "fit": {"table": [row(20, "best-last", {"bm25": 0.4, "heads": 0.6}),
                                 row(14, "first-stage", {"bm25": 1.0, "heads": 0.0})]}}
    assert fitted_setting(section, "cuda")["depth"] == 20
    assert fitted_setting(section, "cpu")["depth"] == 14
    assert fitted_weights(section, 14, 128, True) == {"bm25": 0.1, "heads": 0.9}
    assert fitted_weights(section, 14, 128, False) == {"bm25": 1.0, "heads": 0.0}
    assert fitted_weights(section, 14, 256, True) is None  # not tried: the caller falls back to the profile's
    assert fitted_setting(section, "cpu")["weights"] == {"bm25": 0.1, "heads": 0.9}  # its setting's row
    section["cpu"]["weights"] = {"bm25": 0.3, "heads": 0.7}  # `calibrate-pipeline --cpu` writes its own choice
    assert fitted_setting(section, "cpu")["weights"] == {"bm25": 0.3, "heads": 0.7}
    assert fitted_setting(section, "cuda")["weights"] == {"bm25": 0.4, "heads": 0.6}


def test_the_cpu_fit_skips_the_second_hop_only_where_the_fit_cannot_tell_it_pays():
    import numpy as np

    from endo_retrieval.calibration.pipeline import cheapest_weights

    grid = [{"bm25": 0.4, "heads": 0.2, "hop2": 0.4}, {"bm25": 0.4, "heads": 0.6, "hop2": 0.0},
            {"bm25": 1.0, "heads": 0.0, "hop2": 0.0}]
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.3, 200)
    # the hop adds 0.01 on average, inside what the questions vary by: the fusion without it is chosen
    swing = np.tile([0.2, -0.2], 100)  # the fusions trade questions, as near ones do
    near = np.stack([0.80 + noise + 0.01, 0.80 + noise + swing, 0.5 + noise])
    assert cheapest_weights(grid, near) == 1
    # the hop adds 0.2 on every question: it pays, and stays
    far = np.stack([0.80 + noise + 0.2, 0.80 + noise, 0.5 + noise])
    assert cheapest_weights(grid, far) == 0


def test_the_shipped_cpu_setting_was_fitted_and_its_weights_are_found(backbone):
    from endo_retrieval.methods.pipeline import EndoPipeline
    from endo_retrieval.model.profiles import heads_profile

    section = heads_profile(backbone)["pipeline"]
    pipe = EndoPipeline(backbone, first_stage="bm25")  # the default model on this CPU, BM25's candidates
    cpu = section["cpu"]
    rows = [r for r in cpu["fit"]["table"] if (r["depth"], r["read_tokens"], r["order"]) ==
            (cpu["depth"], pipe.read_tokens, "best-last" if pipe.best_last else "first-stage")]
    assert pipe.depth == cpu["depth"] < section["depth"]
    assert len(rows) == 1 and pipe.weights == rows[0]["weights"]
    assert EndoPipeline(backbone, depth=section["depth"], first_stage="bm25").weights == section["weights"]


def test_an_index_that_reads_no_features_never_loads_the_saes(backbone, monkeypatch):
    """bm25, endo and endo-2hop index no SAE features, so they must not pay for reading the SAEs from disk (every
    `compress()` builds an index); s3 does read them."""
    from endo_retrieval import EndoIndex
    from endo_retrieval.model.sae import SAEBank

    loads = []
    real = SAEBank.for_backbone.__func__
    monkeypatch.setattr(SAEBank, "for_backbone", classmethod(lambda cls, bb, device=None: loads.append(1) or
                                                             real(cls, bb, device)))
    for method in ("bm25", "endo", "endo-2hop"):
        EndoIndex(backbone=backbone, method=method)
    assert loads == []
    EndoIndex(backbone=backbone, method="s3")
    assert loads == [1]
