"""The installed wheel's smoke test: the retriever, built as LlamaIndex users build one, finds the passage.
Run with `python smoke.py` in a venv holding this distribution (its dependencies and the default model)."""
from llama_index.core import Document
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.retrievers.endo import EndoRetriever

TEXTS = ["The Zephyr bridge crosses the Varna river. Workers found quartz under it in 1911.",
         "The Varna river flows into the Black Sea near the port of Varna.",
         "Quarry owners in the hills sold granite to the railway company."]

if __name__ == "__main__":
    retriever = EndoRetriever.from_defaults(documents=[Document(text=t) for t in TEXTS], similarity_top_k=1)
    assert isinstance(retriever, BaseRetriever)
    hits = retriever.retrieve("Which mineral did workers find under the Zephyr bridge?")
    assert len(hits) == 1 and "quartz" in hits[0].node.get_content(), hits
    print("llama-index-retrievers-endo: ok,", hits[0].node.get_content()[:60])
