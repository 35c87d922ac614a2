"""`endo bench ...` with S3's question encoded from its keys instead of its queries (a probe, not a product option).

[S3 Eq. 6] encodes the question's pre-RoPE queries with the SAEs trained on keys; their reconstruction error is
above 1 on the models here (docs/papers.md), so a question's features may not be those of the tokens it attends
to. This probe encodes the question's own keys with the same SAEs (feature co-activation between the question's
keys and the context's keys), to see whether the query side is where S3's signal is lost.

    python tools/s3_key_probe.py bench quality --data ../shared/data/hotpotqa/dev30.json --context-tokens 8192 \
        --budget 1024 --methods s3,s3-hybrid --no-generate --no-reference --out s3_keys.json
"""
import sys

from endo_retrieval.cli import main
from endo_retrieval.index import engine


def key_features(self, question: str) -> dict:
    """{layer: (feature ids, weights)} of the question's pre-RoPE keys (as `IndexStore.query_features` gives its
    queries')."""
    ids = self.backbone.encode(question).ids
    out = {}
    for chunk in self.backbone.stream(ids, self.saes.layers, chunk_size=max(1, len(ids)), capture=("k",)):
        for layer, keys in chunk.keys.items():
            feat, act = self.saes.encode_keys(layer, keys)
            keep = act > 0
            out[layer] = (feat[keep].cpu().numpy(), act[keep].float().cpu().numpy())
    return out


engine.IndexStore.query_features = key_features
sys.exit(main())
