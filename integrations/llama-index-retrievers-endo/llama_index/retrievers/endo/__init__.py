from llama_index.retrievers.endo.base import (EndoRetrievalStages, EndoRetriever, metadata_predicate, span_node,
                                              to_documents)

__all__ = ["EndoRetrievalStages", "EndoRetriever", "metadata_predicate", "span_node", "to_documents"]
