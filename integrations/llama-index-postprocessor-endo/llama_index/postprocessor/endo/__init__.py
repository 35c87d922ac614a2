from llama_index.postprocessor.endo.base import EndoCompressor, EndoReranker

__all__ = ["EndoCompressor", "EndoReranker"]
