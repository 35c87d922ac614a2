"""LangChain adapters: the standard retriever suite (unmodified), k at construction and invoke time, provenance,
the document compressor, ChatEndo (streaming, the tool policy) and create_retriever_tool."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402

from langchain_endo import ChatEndo, EndoDocumentCompressor, EndoRetriever  # noqa: E402
from langchain_endo.chat_models import to_chat  # noqa: E402

TEXTS = [
    "The Zephyr bridge crosses the Varna river. It was painted bright green in 1932 by the city council. "
    "Tourists photograph it at sunset.",
    "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971. "
    "She later taught at Warsaw university.",
    "The Orion cafe serves espresso and cardamom buns. It opens at seven in the morning every weekday. "
    "Its owner is Jonas Berg.",
    "The research ship Albatross carries twelve scientists. Its home port is Gdansk on the Baltic coast. "
    "It was launched in 1988.",
]


@functools.cache
def saved_index() -> str:
    """Index the texts once per session; the standard suite then builds its retrievers from the folder."""
    folder = Path(tempfile.mkdtemp(prefix="endo-lc-")) / "index"
    EndoRetriever(texts=TEXTS, index_dir=folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.anyio  # runs the suite's async test on asyncio (the suite itself stays unmodified)
class TestEndoRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[EndoRetriever]:
        return EndoRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"index_dir": saved_index()}

    @property
    def retriever_query_example(self) -> str:
        return "What color was the Zephyr bridge painted?"


# ---- fast: message conversion and the tool policy's checks --------------------------------------------------------
def test_to_chat_folds_tool_results_into_the_last_user_turn():
    msgs = [SystemMessage("Be brief."), HumanMessage("hi"), AIMessage("hello"), HumanMessage("Where?"),
            AIMessage("", tool_calls=[{"name": "s", "args": {"query": "Where?"}, "id": "1"}]),
            ToolMessage("Gdansk is the port.", tool_call_id="1")]
    assert to_chat(msgs) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Context:\nGdansk is the port.\n\nAnswer the question using the context.\n"
                                    "Question: Where?"}]


def test_compressor_rejects_unknown_method():
    with pytest.raises(ValueError, match="compression method"):
        EndoDocumentCompressor(method="bm42")


# ---- the real model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def retriever(backbone):
    return EndoRetriever(index_dir=saved_index(), backbone=backbone)


@pytest.mark.slow
def test_invoke_k_overrides_constructor_k_and_carries_provenance(retriever):
    assert len(retriever.invoke("Where is the home port of the Albatross?")) == 4
    docs = retriever.invoke("Where is the home port of the Albatross?", k=2)
    assert len(docs) == 2
    top = docs[0]
    source = TEXTS[int(top.metadata["doc_id"].removeprefix("doc-"))]
    assert source[top.metadata["char_start"]:top.metadata["char_end"]] == top.page_content
    assert any("Gdansk" in d.page_content for d in docs)


@pytest.mark.slow
def test_documents_keep_their_ids_and_metadata(backbone):
    docs = [Document(page_content=t, id=f"t{i}", metadata={"n": i}) for i, t in enumerate(TEXTS[:2])]
    hits = EndoRetriever(documents=docs, k=2, backbone=backbone).invoke("Which compound did Marta Kowal discover?")
    assert {h.metadata["doc_id"] for h in hits} <= {"t0", "t1"}
    assert all(h.metadata["n"] == int(h.metadata["doc_id"][1]) for h in hits)
    assert [h.id for h in hits] == [h.metadata["doc_id"] for h in hits]  # one hit per document, named by its id
    with pytest.raises(ValueError, match="JSON-serialisable"):
        EndoRetriever(documents=[Document(page_content="x y z.", metadata={"f": object()})], backbone=backbone)
    with pytest.raises(ValueError, match="Give documents"):
        EndoRetriever(backbone=backbone)


@pytest.mark.slow
def test_compressor_in_contextual_compression_retriever(retriever, backbone):
    from langchain_classic.retrievers import ContextualCompressionRetriever

    from endo_retrieval import compress
    from endo_retrieval.integrations import PASSAGE_SEPARATOR

    question, budget = "Which compound did Marta Kowal discover?", 40
    docs = [Document(page_content=t, metadata={"n": i}) for i, t in enumerate(TEXTS)]
    out = EndoDocumentCompressor(budget=budget).compress_documents(docs, question)
    ns = [d.metadata["n"] for d in out]
    assert ns and ns == sorted(ns)  # input order kept
    for d in out:
        spans = d.metadata["endo_char_spans"]  # kept ranges of the document's original page_content
        source = TEXTS[d.metadata["n"]]
        expected = source[spans[0][0]:spans[0][1]] + "".join(
            ("" if a == prev_b else "\n") + source[a:b] for (_, prev_b), (a, b) in zip(spans, spans[1:]))
        assert d.page_content == expected
    assert sum(backbone.count_tokens(d.page_content) for d in out) <= budget + len(out)
    # reference: compress() on the documents joined as one context keeps exactly the same characters
    context = PASSAGE_SEPARATOR.join(TEXTS)
    starts = [context.index(t) for t in TEXTS]
    reference = {i for s in compress(context, question, budget, backbone=backbone).spans
                 for i in range(s.char_start, s.char_end) if not context[i].isspace()}
    kept = {starts[d.metadata["n"]] + i for d in out for a, b in d.metadata["endo_char_spans"] for i in range(a, b)
            if not TEXTS[d.metadata["n"]][i].isspace()}
    assert kept == reference

    pipeline = ContextualCompressionRetriever(base_compressor=EndoDocumentCompressor(budget=24),
                                              base_retriever=retriever)
    assert any("Gdansk" in d.page_content for d in pipeline.invoke("Where is the home port of the Albatross?"))


@pytest.mark.slow
def test_chat_invoke_and_stream_agree():
    chat = ChatEndo(max_new_tokens=12)
    text = chat.invoke("Name a colour.").content
    assert text
    assert "".join(c.content for c in chat.stream("Name a colour.")) == text
    last_word = text.split()[-1]
    assert chat.invoke("Name a colour.", stop=[last_word]).content == text[:text.index(last_word)]
    sparse = ChatEndo(max_new_tokens=12, attention="reattention")  # the prompt fits the local part: same answer
    assert sparse.invoke("Name a colour.").content == text
    assert "".join(c.content for c in sparse.stream("Name a colour.")) == text


@pytest.mark.slow
def test_retriever_tool_and_the_chat_models_tool_policy(retriever):
    from langchain_core.tools import create_retriever_tool

    tool = create_retriever_tool(retriever, "search_facts", "Search the facts.")
    assert "Gdansk" in tool.invoke({"query": "Where is the home port of the Albatross?"})

    chat = ChatEndo(max_new_tokens=24).bind_tools([tool])
    question = HumanMessage("Where is the home port of the Albatross?")
    call = chat.invoke([question])
    assert call.tool_calls[0]["name"] == "search_facts"
    assert call.tool_calls[0]["args"] == {"query": question.content}
    result = ToolMessage(tool.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"])
    answer = chat.invoke([question, call, result])
    assert not answer.tool_calls and "Gdansk" in answer.content

    with pytest.raises(ValueError, match="one tool per turn"):
        ChatEndo().bind_tools([tool, create_retriever_tool(retriever, "other", "Other.")])
