"""LlamaIndex adapters: EndoRetriever, EndoCompressor, EndoLLM, the agent tool; persistence across processes, one
shared backbone, thread safety and bad input."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("llama_index.core")
from llama_index.core import Document  # noqa: E402
from llama_index.core.schema import NodeRelationship, NodeWithScore, TextNode  # noqa: E402

from endo_retrieval.core import Span  # noqa: E402

DOCS = {
    "bridge": "The Zephyr bridge crosses the Varna river. It was painted bright green in 1932 by the city council. "
              "Tourists photograph it at sunset.",
    "chemist": "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971. "
               "She later taught at Warsaw university.",
    "cafe": "The Orion cafe serves espresso and cardamom buns. It opens at seven in the morning every weekday. "
            "Its owner is Jonas Berg.",
    "ship": "The research ship Albatross carries twelve scientists. Its home port is Gdansk on the Baltic coast. "
            "It was launched in 1988.",
}
QUESTIONS = ["What color was the Zephyr bridge painted?", "Which compound did Marta Kowal discover?",
             "When does the Orion cafe open?", "Where is the home port of the Albatross?"]
GOLD = ["bridge", "chemist", "cafe", "ship"]


def documents(**meta) -> list[Document]:
    return [Document(id_=doc_id, text=text, metadata={"title": doc_id, **meta}) for doc_id, text in DOCS.items()]


def snapshot(nodes: list[NodeWithScore]) -> list[tuple]:
    return [(n.node.node_id, n.node.text, n.score, n.node.metadata["doc_id"]) for n in nodes]


@pytest.fixture(scope="module")
def retriever():
    from llama_index.retrievers.endo import EndoRetriever

    return EndoRetriever.from_documents(documents(), similarity_top_k=2)


# ---- fast: the passage <-> span bookkeeping of the compressor, against hand-computed pieces ------------------------
def test_compress_passages_maps_spans_back_to_passages(monkeypatch):
    from endo_retrieval import integrations
    from endo_retrieval.core import Compressed

    passages = ["alpha beta", "gamma delta", "eps"]  # joined: "alpha beta\n\ngamma delta\n\neps"
    context = "\n\n".join(passages)
    # "alpha"; a span crossing from passage 0 into 1; one inside a separator only; "delta"
    cuts = [(0, 5), (8, 14), (10, 12), (18, 23)]

    def fake_compress(ctx, question, budget, method, backbone):
        assert ctx == context
        return Compressed("", [Span(0, 1, a, b, ctx[a:b]) for a, b in cuts], 3, method, budget)

    monkeypatch.setattr(integrations, "compress", fake_compress)
    kept = integrations.compress_passages(passages, "q", 10)
    assert [k.passage for k in kept] == [0, 1]  # passage 2 kept nothing and is dropped; order is passage order
    assert kept[0].char_spans == ((0, 5), (8, 10)) and kept[0].text == "alpha\nta"
    assert kept[1].char_spans == ((0, 2), (6, 11)) and kept[1].text == "ga\ndelta"
    with pytest.raises(ValueError, match="compression method"):
        integrations.compress_passages(passages, "q", 10, method="bm42")
    with pytest.raises(ValueError, match="question"):
        integrations.compress_passages(passages, "  ", 10)


def test_constructor_needs_one_source():
    from llama_index.retrievers.endo import EndoRetriever

    with pytest.raises(ValueError, match="Give documents"):
        EndoRetriever.from_defaults()
    with pytest.raises(ValueError, match="not both"):
        EndoRetriever.from_defaults(nodes=[], documents=[])


# ---- the real model -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_retrieve_returns_spans_linked_to_their_source(retriever):
    for question, gold in zip(QUESTIONS, GOLD):
        hits = retriever.retrieve(question)
        assert 1 <= len(hits) <= 2
        assert gold in [h.node.metadata["doc_id"] for h in hits]  # ranking quality is the engine's tests' job
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        for hit in hits:
            node, meta = hit.node, hit.node.metadata
            doc_id = meta["doc_id"]
            assert meta["title"] == doc_id  # the document's own metadata travels with its spans
            assert DOCS[doc_id][meta["char_start"]:meta["char_end"]] == node.text  # exact offsets in the source
            assert (node.start_char_idx, node.end_char_idx) == (meta["char_start"], meta["char_end"])
            assert node.relationships[NodeRelationship.SOURCE].node_id == doc_id
            assert "char_start" not in node.get_content(metadata_mode="llm")  # provenance stays out of the prompt


@pytest.mark.slow
@pytest.mark.parametrize("method", ["s3-hybrid", "bm25"])
def test_short_documents_are_searchable(method, backbone):
    """Chunks of one or two sentences are what RAG pipelines index most."""
    from llama_index.retrievers.endo import EndoRetriever

    docs = [Document(id_="one", text="Lodzite was discovered in 1971."),
            Document(id_="two", text="The bridge is green. It crosses the Varna river.")]
    hits = EndoRetriever.from_documents(docs, similarity_top_k=1, method=method, backbone=backbone).retrieve(
        "When was lodzite discovered?")
    assert hits[0].node.metadata["doc_id"] == "one"


@pytest.mark.slow
def test_async_retrieve_equals_sync(retriever):
    async def both():
        return await asyncio.gather(*(retriever.aretrieve(q) for q in QUESTIONS))

    assert [snapshot(r) for r in asyncio.run(both())] == [snapshot(retriever.retrieve(q)) for q in QUESTIONS]


@pytest.mark.slow
def test_concurrent_queries_equal_sequential(retriever):
    sequential = [snapshot(retriever.retrieve(q)) for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda q: snapshot(retriever.retrieve(q)), QUESTIONS * 2))
    assert concurrent == sequential * 2


@pytest.mark.slow
def test_from_nodes_matches_from_documents(retriever):
    from llama_index.retrievers.endo import EndoRetriever

    nodes = [TextNode(id_=d.doc_id, text=d.text, metadata=d.metadata) for d in documents()]
    from_nodes = EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=2, backbone=retriever.index.backbone)
    assert snapshot(from_nodes.retrieve(QUESTIONS[1])) == snapshot(retriever.retrieve(QUESTIONS[1]))


FRESH_PROCESS = r"""
import gc, json, sys
from endo_retrieval import Backbone
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.endo import EndoLLM
from llama_index.postprocessor.endo import EndoCompressor
from llama_index.retrievers.endo import EndoRetriever

retriever = EndoRetriever.from_persist_dir(sys.argv[1])
compressor, llm = EndoCompressor(budget=48), EndoLLM(max_new_tokens=4)
hits = {q: [(n.node.node_id, n.node.text, n.score) for n in retriever.retrieve(q)] for q in json.loads(sys.argv[2])}
compressor.postprocess_nodes([NodeWithScore(node=TextNode(text=t), score=1.0) for t in json.loads(sys.argv[3])],
                             query_str="Which compound?")
llm.complete("Hi")
models = {id(o) for o in gc.get_objects() if isinstance(o, Backbone)}
torch_models = {id(o) for o in gc.get_objects() if type(o).__name__.endswith("ForCausalLM")}
print(json.dumps({"hits": hits, "top_k": retriever.similarity_top_k, "backbones": len(models),
                  "torch_models": len(torch_models)}))
"""


@pytest.mark.slow
def test_persist_then_reload_in_a_fresh_process_gives_identical_results(retriever, tmp_path):
    retriever.persist(tmp_path / "idx")
    expected = {q: [[n.node.node_id, n.node.text, n.score] for n in retriever.retrieve(q)] for q in QUESTIONS}
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "idx"), json.dumps(QUESTIONS),
                          json.dumps(list(DOCS.values()))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hits"] == expected and got["top_k"] == 2
    # retriever, compressor and LLM together hold one backbone and one copy of the weights
    assert got["backbones"] == 1 and got["torch_models"] == 1


@pytest.mark.slow
def test_defaults_share_one_backbone(retriever):
    from llama_index.llms.endo import EndoLLM
    from llama_index.postprocessor.endo import EndoCompressor

    from endo_retrieval import Backbone

    shared = Backbone.default()
    assert retriever.index.backbone is shared
    assert EndoCompressor()._backbone is shared and EndoLLM().backbone is shared


@pytest.mark.slow
@pytest.mark.parametrize("method", ["s3-hybrid", "s3", "ilre"])
def test_compressor_keeps_evidence_in_order_with_provenance(method, backbone):
    from llama_index.core.schema import RelatedNodeInfo
    from llama_index.postprocessor.endo import EndoCompressor

    from endo_retrieval.model.profiles import ilre_profile

    if method == "ilre" and ilre_profile(backbone) is None:
        pytest.skip("no shipped ILRe profile for the default model yet (endo calibrate-ilre)")
    parent = Document(id_="all", text=" ".join(DOCS.values()))
    nodes, start = [], 0
    for doc_id, text in DOCS.items():  # chunks of one parent document, as a splitter would make them
        node = TextNode(id_=doc_id, text=text, start_char_idx=start, end_char_idx=start + len(text),
                        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="all")},
                        metadata={"title": doc_id})
        nodes.append(NodeWithScore(node=node, score=1.0 / (1 + len(nodes))))
        start += len(text) + 1
    budget = 40
    out = EndoCompressor(budget=budget, method=method).postprocess_nodes(nodes, query_str=QUESTIONS[1])
    kept_ids = [n.node.node_id.removesuffix(":endo") for n in out]
    assert kept_ids and kept_ids == [d for d in DOCS if d in kept_ids]  # retriever order kept
    assert sum(backbone.count_tokens(n.node.text) for n in out) <= budget + len(out)  # joins may re-tokenise
    by_id = {n.node.node_id: n for n in nodes}
    parent_start = {n.node.node_id: n.node.start_char_idx for n in nodes}
    for n in out:
        source = by_id[n.node.node_id.removesuffix(":endo")]
        assert n.score == source.score and n.node.metadata["title"] == source.node.metadata["title"]
        assert n.node.source_node.node_id == "all"
        spans = n.node.metadata["endo_char_spans"]  # offsets in the parent document the chunk was cut from
        assert n.node.text == parent.text[spans[0][0]:spans[0][1]] + "".join(
            ("" if a == prev_b else "\n") + parent.text[a:b] for (_, prev_b), (a, b) in zip(spans, spans[1:]))
        assert all(parent_start[source.node.node_id] <= a < b <= source.node.end_char_idx for a, b in spans)

    # reference: compress() on the passages joined as one context keeps exactly the same characters
    from endo_retrieval import compress
    from endo_retrieval.integrations import PASSAGE_SEPARATOR

    texts = list(DOCS.values())
    context = PASSAGE_SEPARATOR.join(texts)
    joined_start = {d: context.index(t) for d, t in DOCS.items()}
    expected = set()
    for span in compress(context, QUESTIONS[1], budget, method, backbone).spans:
        expected |= {i for i in range(span.char_start, span.char_end) if not context[i].isspace()}
    got = set()
    for n in out:
        doc_id = n.node.node_id.removesuffix(":endo")
        shift = joined_start[doc_id] - parent_start[doc_id]
        got |= {i + shift for a, b in n.node.metadata["endo_char_spans"] for i in range(a, b)
                if not parent.text[i].isspace()}
    assert got == expected


@pytest.mark.slow
def test_llm_complete_chat_and_stream_agree():
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.endo import EndoLLM

    llm = EndoLLM(max_new_tokens=12)
    text = llm.complete("Name a colour.").text
    assert text
    streamed = list(llm.stream_complete("Name a colour."))
    assert "".join(r.delta for r in streamed) == streamed[-1].text == text  # greedy: streaming changes nothing
    chat = llm.chat([ChatMessage(role="user", content="Name a colour.")])
    assert chat.message.content == text
    assert list(llm.stream_chat([ChatMessage(role="user", content="Name a colour.")]))[-1].message.content == text
    assert llm.metadata.is_chat_model and llm.metadata.context_window == 8192
    sparse = EndoLLM(max_new_tokens=12, attention="reattention")  # the prompt fits the local part: same answer
    assert sparse.complete("Name a colour.").text == text
    assert list(sparse.stream_chat([ChatMessage(role="user", content="Name a colour.")]))[-1].message.content == text


@pytest.mark.slow
def test_agent_tool_returns_evidence(retriever):
    tool = retriever.as_tool()
    assert tool.metadata.name == "endo_search"
    assert "green" in str(tool.call(QUESTIONS[0]))


# ---- bad input: clear errors, nothing overwritten ---------------------------------------------------------------
@pytest.mark.slow
def test_bad_input_gives_clear_errors_and_overwrites_nothing(retriever, tmp_path):
    from llama_index.retrievers.endo import EndoRetriever

    bb = retriever.index.backbone
    with pytest.raises(ValueError, match="empty|text"):
        EndoRetriever.from_defaults(documents=[Document(id_="x", text="")], backbone=bb,
                                    persist_dir=tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="JSON-serialisable"):
        EndoRetriever.from_defaults(documents=documents(when=object()), backbone=bb)
    with pytest.raises(FileNotFoundError, match="No saved index"):
        EndoRetriever.from_persist_dir(tmp_path / "missing")

    saved = tmp_path / "saved"
    retriever.persist(saved)
    before = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="already holds an index"):
        EndoRetriever.from_defaults(documents=documents(), persist_dir=saved, backbone=bb)
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == before

    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved, corrupt)
    (corrupt / "endo-index.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        EndoRetriever.from_persist_dir(corrupt)
    assert (corrupt / "endo-index.json").read_text() == "{not json"

    from conftest import make_tiny_model

    from endo_retrieval import Backbone

    other_model = Backbone(make_tiny_model("llama", tmp_path / "tiny", layers=2), device="cpu")
    with pytest.raises(ValueError, match="built with model"):
        EndoRetriever.from_persist_dir(saved, backbone=other_model)
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == before
