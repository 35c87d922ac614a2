"""LlamaIndex: a RetrieverQueryEngine whose retriever and LLM are the same local model.

EndoRetriever finds the evidence with the default pipeline (BM25 candidates, read by the model, ranked by its
retrieval heads); EndoLLM answers from it. Runs offline on the embedded default model (SmolLM2-135M-Instruct).
"""
from llama_index.core import Document
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.endo import EndoLLM
from llama_index.retrievers.endo import EndoRetriever

DOCUMENTS = [
    Document(id_="bridge", text="The Zephyr bridge crosses the Varna river. It was painted bright green in 1932 "
                                "by the city council. Tourists photograph it at sunset."),
    Document(id_="chemist", text="Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971. "
                                 "She later taught at Warsaw university."),
    Document(id_="cafe", text="The Orion cafe serves espresso and cardamom buns. It opens at seven in the morning "
                              "every weekday. Its owner is Jonas Berg."),
]
QUESTION = "Which compound did Marta Kowal discover?"


def main() -> str:
    retriever = EndoRetriever.from_documents(DOCUMENTS, similarity_top_k=1)
    engine = RetrieverQueryEngine.from_args(retriever, llm=EndoLLM(max_new_tokens=32))
    response = engine.query(QUESTION)
    for hit in response.source_nodes:
        meta = hit.node.metadata
        print(f"evidence [{meta['doc_id']} {meta['char_start']}:{meta['char_end']}] {hit.node.text}")
    print(f"Q: {QUESTION}\nA: {response}")
    return str(response)


if __name__ == "__main__":
    main()
