"""compress() at 8192 / 1024 on this CPU, with the SAEs read from disk per call (as indexes for bm25 and endo used to)
and without (now), side by side: five 8k contexts of dev300's paragraphs, each asked REPEAT times.

    .venv/bin/python tools/compress_host_time.py bm25 2      (METHODS comma-separated, REPEAT)
"""
import json
import statistics
import sys
import time

from endo_retrieval import Backbone
from endo_retrieval.index import engine
from endo_retrieval.methods import compress
from endo_retrieval.model.sae import SAEBank, SAEError

items = json.load(open("../shared/data/hotpotqa/dev300.json"))  # run from the repository
bb = Backbone()
now = engine._model_saes


def before(backbone, needed):
    """What every index did: the model's SAEs read from disk, a stand-in where it has none."""
    try:
        return SAEBank.for_backbone(backbone)
    except SAEError:
        return now(backbone, needed)


contexts = []
for start in range(0, 200, 40):
    text = ""
    for item in items[start:start + 40]:
        for title, sentences in item["context"]:
            if bb.count_tokens(text) < 8000:
                text += title + ": " + " ".join(sentences) + "\n\n"
    contexts.append((text, items[start]["question"]))

for method in sys.argv[1].split(","):
    for name, saes in (("SAEs read per call", before), ("no SAEs read", now)):
        engine._model_saes = saes
        compress(*contexts[0], 1024, method=method, backbone=bb)  # warm
        ms = []
        for text, question in contexts * int(sys.argv[2]):
            start = time.perf_counter()
            compress(text, question, 1024, method=method, backbone=bb)
            ms.append(1000 * (time.perf_counter() - start))
        print(f"{method}, {name}: {statistics.median(ms):.1f} ms p50 over {len(ms)} calls", flush=True)
