"""The default `endo` with its dense first stage, through the real frameworks with the real default model and the
real all-MiniLM-L6-v2 package: a question that shares no word with its evidence is answered from it in a
LlamaIndex query engine and a LangChain chain, where the same retriever with BM25 candidates alone cannot reach it."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

# the evidence says "feline" and "slumbered"; the question says "cat" and "sleep"
EVIDENCE = "A grey feline slumbered on a woven rug beside a warm stove all afternoon."
# more documents than the model reads (DEPTH): BM25, finding none of the question's words anywhere, ranks them in
# corpus order with the evidence last, so without the dense stage it never reaches the model
FILLER = [f"The {w} committee met on {d} to discuss the {t} and the new ferry timetable."
          for w in ("finance", "planning", "transport", "harbour", "parks")
          for d, t in (("Monday", "budget"), ("Tuesday", "bridge"), ("Wednesday", "library"), ("Friday", "museum"),
                       ("Sunday", "market"))]
DEPTH = 20
QUESTION = "Where did the cat sleep?"


def test_a_paraphrase_is_found_through_the_dense_stage_in_a_query_engine_and_a_chain(backbone, tmp_path):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_endo import EndoRetriever as LCRetriever
    from llama_index.core import Document
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.llms.endo import EndoLLM
    from llama_index.retrievers.endo import EndoRetriever

    docs = [Document(text=t, id_=f"d{i}") for i, t in enumerate([*FILLER, EVIDENCE])]
    retriever = EndoRetriever.from_defaults(documents=docs, backbone=backbone, similarity_top_k=3, depth=DEPTH,
                                           persist_dir=tmp_path / "idx")
    assert retriever.index.dense is not None and retriever.index.pipeline("endo").first_stage == "hybrid"
    engine = RetrieverQueryEngine.from_args(retriever, llm=EndoLLM(backbone=backbone, max_new_tokens=8))
    response = engine.query(QUESTION)
    found = {n.node.text: n.node.metadata["endo_stage_scores"] for n in response.source_nodes}
    assert EVIDENCE in found
    stages = found[EVIDENCE]
    assert stages["bm25"] == 0.0 and stages["dense"] > 0.3  # no shared word: the embedder found it

    bm25_only = EndoRetriever.from_defaults(documents=docs, backbone=backbone, similarity_top_k=3, depth=DEPTH,
                                            first_stage="bm25")
    assert bm25_only.index.dense is None
    assert EVIDENCE not in [n.node.text for n in bm25_only.retrieve(QUESTION)]  # never among the candidates

    # the saved index, its vectors memory-mapped
    lc = LCRetriever(index_dir=tmp_path / "idx", k=3, depth=DEPTH, backbone=backbone)
    prompt = ChatPromptTemplate.from_template("Context: {context}\nQuestion: {question}")
    chain = ({"context": lc | RunnableLambda(lambda ds: "\n".join(d.page_content for d in ds)),
              "question": RunnablePassthrough()}
             | prompt | RunnableLambda(lambda p: p.to_string()) | StrOutputParser())
    assert EVIDENCE in chain.invoke(QUESTION)
    with pytest.raises(ValueError, match="all-MiniLM-L6-v2"):
        LCRetriever(index_dir=tmp_path / "idx", k=1, backbone=backbone, embedder="another-embedder")
