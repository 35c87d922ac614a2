"""The installed wheel's smoke test: the reranker, given a first stage's nodes worst first, puts the passage that
answers first. Run with `python smoke.py` in a venv holding this distribution."""
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.postprocessor.endo import EndoReranker, MiniLMEmbedding

TEXTS = ["Quarry owners in the hills sold granite to the railway company.",
         "The Varna river flows into the Black Sea near the port of Varna.",
         "The Zephyr bridge crosses the Varna river. Workers found quartz under it in 1911."]

if __name__ == "__main__":
    reranker = EndoReranker(top_n=1)
    assert isinstance(reranker, BaseNodePostprocessor)
    nodes = [NodeWithScore(node=TextNode(text=t), score=1.0) for t in TEXTS]
    kept = reranker.postprocess_nodes(nodes, query_str="Which mineral did workers find under the Zephyr bridge?")
    assert len(kept) == 1 and "quartz" in kept[0].node.get_content(), kept
    assert len(MiniLMEmbedding().get_query_embedding("a bridge")) == 384  # the store the reranker was fitted after
    print("llama-index-postprocessor-endo: ok, score", kept[0].score)
