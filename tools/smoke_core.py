"""The core wheel's smoke test in a venv holding endo-retrieval alone: it imports without LlamaIndex or LangChain,
ships its assets, and the default pipeline finds the passage. Run with `python tools/smoke_core.py`."""
import importlib.util
import sys

from endo_retrieval import EndoIndex, compress

TEXTS = ["The Zephyr bridge crosses the Varna river. Workers found quartz under it in 1911.",
         "The Varna river flows into the Black Sea near the port of Varna.",
         "Quarry owners in the hills sold granite to the railway company."]
QUESTION = "Which mineral did workers find under the Zephyr bridge?"

if __name__ == "__main__":
    assert not any(m.startswith(("llama_index", "langchain")) for m in sys.modules)
    assert importlib.util.find_spec("llama_index") is None  # the adapters ship in distributions of their own
    index = EndoIndex()
    index.add_documents(TEXTS)
    assert index.dense is not None  # the dense first stage, with the bundled embedder the install names
    hit = index.search(QUESTION, k=1)[0]
    assert "quartz" in hit.text, hit
    assert "quartz" in compress(" ".join(TEXTS), QUESTION, budget=24).text
    print("endo-retrieval: ok,", hit.text[:60])
