"""The installed wheel's smoke test: the retriever and the reranker, used as LangChain users use them, find the
passage. Run with `python smoke.py` in a venv holding this distribution."""
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_endo import EndoReranker, EndoRetriever

TEXTS = ["The Zephyr bridge crosses the Varna river. Workers found quartz under it in 1911.",
         "The Varna river flows into the Black Sea near the port of Varna.",
         "Quarry owners in the hills sold granite to the railway company."]
QUESTION = "Which mineral did workers find under the Zephyr bridge?"

if __name__ == "__main__":
    retriever = EndoRetriever(texts=TEXTS, k=1)
    assert isinstance(retriever, BaseRetriever)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 1 and "quartz" in docs[0].page_content, docs
    # a first stage that scores them all alike, worst first: the heads decide
    first_stage = [Document(page_content=t, metadata={"score": 1.0}) for t in reversed(TEXTS)]
    kept = EndoReranker(top_n=1).compress_documents(first_stage, QUESTION)
    assert "quartz" in kept[0].page_content, kept
    print("langchain-endo: ok,", docs[0].page_content[:60])
