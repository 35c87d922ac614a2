from llama_index.postprocessor.endo.base import EndoCompressor, EndoReranker
from llama_index.postprocessor.endo.embedding import MiniLMEmbedding

__all__ = ["EndoCompressor", "EndoReranker", "MiniLMEmbedding"]
