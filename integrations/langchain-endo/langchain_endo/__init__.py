"""`langchain_endo`: endogenous retrieval (S3-Attention, ILRe) for LangChain: a retriever, a document compressor
and a reranker for `ContextualCompressionRetriever`, and the local backbone as a chat model. All share one loaded
model."""
from langchain_endo.chat_models import ChatEndo
from langchain_endo.compressors import EndoDocumentCompressor, EndoReranker
from langchain_endo.retrievers import EndoRetriever

__all__ = ["ChatEndo", "EndoDocumentCompressor", "EndoReranker", "EndoRetriever"]
