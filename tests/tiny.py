"""A tiny random-weight engine for the reliability tests: a 2-layer Llama with the default model's tokenizer and
random SAEs, built once per process without loading the default model's weights (plumbing, not quality)."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

FILLER = ("The river bends twice before the old mill. Farmers sell apples at the market on Sundays. "
          "A quiet road leads up the hill to the chapel. ")
DOCS = {"mill": FILLER * 3,
        "vault": "The vault combination is 4417, said the caretaker. " + FILLER,
        "ship": "The research ship Albatross carries twelve scientists. Its home port is Gdansk on the Baltic coast.",
        "cafe": "The Orion cafe serves espresso and cardamom buns. It opens at seven every weekday."}
QUESTIONS = ["What is the vault combination?", "Where is the home port of the Albatross?",
             "When does the cafe open?"]


@functools.lru_cache(maxsize=None)
def tiny_engine():
    """(backbone, SAE bank) of a random 2-layer Llama; SAEs on both layers, 256 latents, k 8."""
    import torch
    import transformers

    from endo_retrieval import Backbone, SAEBank, TopKSAE
    from endo_retrieval.model.backbone import convert_gguf, default_gguf, file_sha256

    gguf = default_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(convert_gguf(gguf, file_sha256(gguf)))
    folder = Path(tempfile.mkdtemp(prefix="endo-tiny-"))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    bb = Backbone(folder, device="cpu")
    bank = SAEBank({l: TopKSAE(bb.head_dim, 256, 8) for l in (0, 1)},
                   {"d_latent": 256, "k": 8, "model_hash": bb.model_hash, "model": bb.model_id})
    return bb, bank


def new_index(method: str = "s3-hybrid"):
    from endo_retrieval import EndoIndex

    bb, bank = tiny_engine()
    return EndoIndex(bb, method=method, saes=bank, chunk_size=64)


def load(folder, **kw):
    from endo_retrieval import EndoIndex

    bb, bank = tiny_engine()
    return EndoIndex.load(folder, bb, saes=bank, **kw)


def docs(*ids: str):
    from endo_retrieval import Document

    return [Document(i, DOCS[i], {"id": i}) for i in ids]


@functools.lru_cache(maxsize=None)
def _features(question: str):
    return new_index().query_features(question)  # the question's features depend on the model and SAEs only


def answers(index, questions=QUESTIONS) -> tuple:
    """What an index answers: its documents and, per question, the spans it returns (hashable, comparable). The
    questions' features are computed once per process (a forward each), since they do not depend on the index."""
    index.query_features = _features
    return (tuple(index.doc_ids),
            tuple(tuple((s.doc_id, s.start, s.end, round(s.score, 6)) for s in index.search(q, k=2))
                  for q in questions))
