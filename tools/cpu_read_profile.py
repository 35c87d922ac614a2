"""Where a CPU question's time goes in the default pipeline: cProfile's own time of the model's linear maps, its
attention (SDPA) and everything else, over dev300 questions asked of an index of their paragraphs.

    python tools/cpu_read_profile.py ../shared/data/hotpotqa/dev300.json [QUESTIONS]   (default 10)
"""
import cProfile
import json
import pstats
import sys
import time

from endo_retrieval import Backbone, EndoIndex

items = json.load(open(sys.argv[1]))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
index = EndoIndex(backbone=Backbone())
index.add_documents([t + ": " + " ".join(s) for it in items for t, s in it["context"]])
questions = [it["question"] for it in items[: n + 1]]
index.search(questions[0], 5)  # warm
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
for q in questions[1:]:
    index.search(q, 5)
profile.disable()
wall = time.perf_counter() - start
stats = pstats.Stats(profile).stats
own = {name: 0.0 for name in ("linear", "scaled_dot_product_attention")}
for (_, _, func), (_, _, tottime, _, _) in stats.items():
    for name in own:
        if func == f"<built-in method torch._C._nn.{name}>":
            own[name] += tottime
rest = wall - sum(own.values())
print(json.dumps({"questions": len(questions) - 1, "per_question_s": round(wall / (len(questions) - 1), 3),
                  "share": {"linear maps": round(own["linear"] / wall, 3),
                            "attention (SDPA)": round(own["scaled_dot_product_attention"] / wall, 3),
                            "everything else": round(rest / wall, 3)}}, indent=1))
