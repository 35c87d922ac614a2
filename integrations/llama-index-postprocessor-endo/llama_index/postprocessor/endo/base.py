"""`llama_index.postprocessor.endo`: the S3 paper's context compression as a LlamaIndex node postprocessor, and
the retrieval heads as a reranker.

Whatever retriever ran first (a vector store, BM25, ...), its nodes are read as one context by the local LM and
cut down to the endogenous evidence under a token budget ([S3 Eq. 8]; or ILRe). Nodes keep their
order and score; each kept node holds only its evidence and links back to the node it was cut from.
EndoReranker re-orders the nodes by the model's query-focused retrieval heads (QRHead, calibrated as in In-Context
Re-ranking) fused with the first stage's own scores, and keeps the best `top_n`.
"""
from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeRelationship, NodeWithScore, QueryBundle, TextNode

from endo_retrieval.model.backbone import Backbone
from endo_retrieval.integrations import (COMPRESS_METHODS, DEFAULT_FIRST_STAGE, check_read_tokens, check_rerank_weights,
                                        compress_passages, rerank_passages)
from endo_retrieval.methods import DEFAULT_METHOD


def texts_and_query(postprocessor: BaseNodePostprocessor, nodes: list[NodeWithScore],
                    query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
    """The query string and the nodes' texts (without metadata: the model reads what the nodes say)."""
    if query_bundle is None:
        raise ValueError(f"{postprocessor.class_name()} needs the query: call postprocess_nodes(nodes, query_str=...) "
                         "or use it inside a query engine.")
    return query_bundle.query_str, [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]


class EndoCompressor(BaseNodePostprocessor):
    """Keep only the evidence of the retrieved nodes, at most `budget` backbone tokens in all."""

    budget: int = Field(default=1024, gt=0, description="token budget for all kept evidence together")
    method: str = Field(default=DEFAULT_METHOD, description=f"one of {', '.join(COMPRESS_METHODS)}")
    _backbone: Backbone = PrivateAttr()

    def __init__(self, budget: int = 1024, method: str = DEFAULT_METHOD, backbone: Backbone | None = None,
                 **kwargs: Any):
        if method not in COMPRESS_METHODS:
            raise ValueError(f"Unknown compression method {method!r}; use one of {', '.join(COMPRESS_METHODS)}.")
        super().__init__(budget=budget, method=method, **kwargs)
        self._backbone = Backbone.of(backbone)  # a loaded backbone, a model folder or GGUF path, or None

    @classmethod
    def class_name(cls) -> str:
        return "EndoCompressor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
                           ) -> list[NodeWithScore]:
        question, passages = texts_and_query(self, nodes, query_bundle)
        kept = compress_passages(passages, question, self.budget, self.method, self._backbone)
        return [self._evidence(nodes[k.passage], k.text, k.char_spans) for k in kept]

    def _evidence(self, retrieved: NodeWithScore, text: str, char_spans) -> NodeWithScore:
        node = retrieved.node
        # link to the document the node was cut from when its offsets there are known, else to the node itself;
        # `endo_char_spans` are character ranges in that source's text
        if node.source_node is not None and node.start_char_idx is not None:
            source, base = node.source_node, node.start_char_idx
        else:
            source, base = node.as_related_node_info(), 0
        extra = ["endo_char_spans", "endo_method"]
        node_text = TextNode(
            id_=f"{node.node_id}:endo",
            text=text,
            metadata={**node.metadata, "endo_char_spans": [[base + a, base + b] for a, b in char_spans],
                      "endo_method": self.method},
            excluded_llm_metadata_keys=[*node.excluded_llm_metadata_keys, *extra],
            excluded_embed_metadata_keys=[*node.excluded_embed_metadata_keys, *extra],
            relationships={**node.relationships, NodeRelationship.SOURCE: source},
        )
        return NodeWithScore(node=node_text, score=retrieved.score)


class EndoReranker(BaseNodePostprocessor):
    """The `top_n` best nodes, best first. By default the first stage's scores (each node's score; its ranks when it
    gave none) and the retrieval heads' scores, each standardised over the nodes, are summed with the weights
    {"first_stage": w, "heads": 1 - w}: `weights` when given, else those fitted for the model and `first_stage`
    ("minilm": a dense vector store, or "bm25"), else 0.5 each; each node's score becomes that sum. `fuse=False`
    ranks by the heads alone, each node's score the heads'. The model reads the nodes as one context: `read_tokens`
    reads each node's best part of at most that many tokens (its first sentence, then those sharing the most words
    with the query; None: whole, as the window allows), far faster over whole documents. A read that takes more
    than a few seconds (a CPU) shows a progress bar (`progress`; None: when standard error is a terminal) and logs
    once which settings read less."""

    top_n: int = Field(default=5, gt=0, strict=True, description="how many nodes to keep")
    fuse: bool = Field(default=True, description="fuse the first stage's scores with the heads' (False: heads alone)")
    first_stage: str = Field(default=DEFAULT_FIRST_STAGE, description="whose fitted weights to fuse with: 'minilm' "
                             "(a dense vector store) or 'bm25'")
    weights: dict[str, float] | None = Field(default=None, description="{'first_stage': w, 'heads': 1 - w}, "
                                             "instead of the fitted ones")
    read_tokens: int | None = Field(default=None, description="tokens read of each node, its best part (None: whole)")
    progress: bool | None = Field(default=None, description="a progress bar on standard error while a slow read "
                                  "runs (None: when it is a terminal)")
    _backbone: Backbone = PrivateAttr()

    def __init__(self, top_n: int = 5, backbone: Backbone | None = None, fuse: bool = True,
                 first_stage: str = DEFAULT_FIRST_STAGE, weights: dict[str, float] | None = None,
                 read_tokens: int | None = None, progress: bool | None = None, **kwargs: Any):
        super().__init__(top_n=top_n, fuse=fuse, first_stage=first_stage,
                         weights=None if weights is None else check_rerank_weights(weights),
                         read_tokens=check_read_tokens(read_tokens), progress=progress, **kwargs)
        self._backbone = Backbone.of(backbone)  # a loaded backbone, a model folder or GGUF path, or None

    @classmethod
    def class_name(cls) -> str:
        return "EndoReranker"

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
                           ) -> list[NodeWithScore]:
        question, passages = texts_and_query(self, nodes, query_bundle)
        ranked = rerank_passages(passages, question, self.top_n, self._backbone, fuse=self.fuse,
                                 first_stage_scores=[n.score for n in nodes], first_stage=self.first_stage,
                                 weights=self.weights, read_tokens=self.read_tokens, progress=self.progress)
        return [NodeWithScore(node=nodes[i].node, score=score) for i, score in ranked]


__all__ = ["EndoCompressor", "EndoReranker"]
