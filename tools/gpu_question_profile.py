"""Where a GPU question's time goes in the default pipeline: dev300's paragraphs as one index, 30 questions asked
first (CUDA graphs captured, shapes seen), then 10 more under torch.profiler: the ops with the most host time and
the most device time per question, beside the pipeline's own stage times.

    python tools/gpu_question_profile.py ../shared/data/hotpotqa/dev300.json [MODEL] [OUT.json]
"""
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from endo_retrieval import Backbone, EndoIndex

items = json.load(open(sys.argv[1]))
backbone = Backbone(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "default" else Backbone.default()
index = EndoIndex(backbone=backbone)
index.add_documents([t + ": " + " ".join(s) for it in items for t, s in it["context"]])
questions = [it["question"] for it in items]
for q in questions[:30]:  # warm: graphs captured and replayed, buckets seen
    index.search(q, 5)
stages = []
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for q in questions[30:40]:
        hits = index.search(q, 5)
        stages.append(hits[0].stage_ms if hits else {})
    if torch.cuda.is_available():
        torch.cuda.synchronize()
n = 10
events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) or
          e.device_type.name == "CUDA"]


def top(key):
    return [{"op": e.key[:90], "calls_per_question": round(e.count / n, 1),
             "host_ms_per_question": round(e.self_cpu_time_total / 1000 / n, 2),
             "device_ms_per_question": round(getattr(e, "self_device_time_total", 0) / 1000 / n, 2)}
            for e in sorted(events, key=key, reverse=True)[:20]]


report = {"model": backbone.model_id, "questions": n,
          "stage_ms_p50": {s: statistics.median(x.get(s, 0.0) for x in stages) for s in
                           sorted({s for x in stages for s in x})},
          "by_host_time": top(lambda e: e.self_cpu_time_total),
          "by_device_time": top(lambda e: getattr(e, "self_device_time_total", 0))}
print(json.dumps(report, indent=1))
if len(sys.argv) > 3:
    open(sys.argv[3], "w").write(json.dumps(report, indent=1))
