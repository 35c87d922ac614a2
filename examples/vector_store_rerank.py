"""LlamaIndex: a vector store first, then the local model's retrieval heads rerank what it found.

The all-MiniLM-L6-v2 vector store ranks the short, on-topic passages above the one that holds the answer (a longer
passage about a city, one of whose sentences names the ship); EndoReranker re-orders the candidates by the
attention the model's query-focused retrieval heads pay from the question to each passage, and keeps the best one
for EndoLLM to answer from. By default the reranker fuses the store's scores with the heads'; here the store is
misled, so `fuse=False` ranks by the heads alone. Runs offline.
"""
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.endo import EndoLLM
from llama_index.postprocessor.endo import EndoReranker, MiniLMEmbedding

DOCUMENTS = [
    Document(text="Research ships carry scientists to remote waters. Many research ships have their home port in "
                  "Bremerhaven or Kiel."),
    Document(text="Every ship is registered at a home port, which is painted on its stern."),
    Document(text="The research ship Polarstern is based in Bremerhaven."),
    Document(text="Gdansk is a city on the Baltic coast of Poland. Its old town was rebuilt after the war, and its "
                  "shipyard was the birthplace of the Solidarity movement. The research ship Albatross has been "
                  "based in Gdansk since 1988."),
]
QUESTION = "What is the home port of the research ship Albatross?"


def main() -> str:
    retriever = VectorStoreIndex.from_documents(DOCUMENTS, embed_model=MiniLMEmbedding()).as_retriever(
        similarity_top_k=4)
    for hit in retriever.retrieve(QUESTION):
        print(f"vector store {hit.score:.3f}: {hit.node.text[:60]!r}")
    engine = RetrieverQueryEngine.from_args(retriever, llm=EndoLLM(max_new_tokens=32),
                                            node_postprocessors=[EndoReranker(top_n=1, fuse=False)])
    response = engine.query(QUESTION)
    for hit in response.source_nodes:
        print(f"reranked {hit.score:.3f}: {hit.node.text[:60]!r}")
    print(f"Q: {QUESTION}\nA: {response}")
    return str(response)


if __name__ == "__main__":
    main()
