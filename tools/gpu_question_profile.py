"""Where a GPU question's time goes: dev300's paragraphs as one index and the default pipeline asked (`corpus`), or
`compress()` of 8k-token contexts made of dev300's paragraphs to 1024 tokens (`compress`); 30 questions first (CUDA
graphs captured, shapes seen), then 10 more under torch.profiler: the ops with the most host time and the most
device time per question, beside the stages' own times; then the same 10 under cProfile: the Python functions with
the most host time of their own (what the host does between launches).

    python tools/gpu_question_profile.py ../shared/data/hotpotqa/dev300.json [MODEL] [OUT.json] [corpus|compress]

DEPTH=N: the candidates read per question (default: the model's profile). WARM=N asks N questions first (default
30; a shape first seen after them is captured inside the profiled window, which `graph_captures_in_window`
counts); TRACE=FILE.json.gz also writes the profiled window's timeline (three questions of it: Chrome trace
format, for where the host keeps the device waiting).
"""
import gzip
import os
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from endo_retrieval import Backbone, EndoIndex
from endo_retrieval.methods import get_method

items = json.load(open(sys.argv[1]))
backbone = Backbone(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "default" else Backbone.default()
mode = sys.argv[4] if len(sys.argv) > 4 else "corpus"
questions = [it["question"] for it in items]


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


if mode == "corpus":
    index = EndoIndex(backbone=backbone)
    index.add_documents([t + ": " + " ".join(s) for it in items for t, s in it["context"]])

    def ask(i: int) -> dict:
        hits = index.search(questions[i], 5, depth=int(os.environ["DEPTH"]) if os.environ.get("DEPTH") else None)
        return hits[0].stage_ms if hits else {}
else:  # each question's own paragraphs, then others', to 8192 tokens: a context that holds its evidence
    method = get_method("endo", backbone=backbone)
    paragraphs = [t + ": " + " ".join(s) for it in items for t, s in it["context"]]

    def context(i: int) -> str:
        text, j = "\n\n".join(t + ": " + " ".join(s) for t, s in items[i]["context"]), 0
        while backbone.count_tokens(text) < 8192 - 200:
            text += "\n\n" + paragraphs[(10 * i + j) % len(paragraphs)]
            j += 1
        return text

    contexts = [context(i) for i in range(int(os.environ.get("WARM", 30)) + 10)]

    def ask(i: int) -> dict:
        t0 = synced()
        prepared = method.prepare(contexts[i])
        t1 = synced()
        method.select(prepared, questions[i], 1024)
        t2 = synced()
        return {"index": 1000 * (t1 - t0), "select": 1000 * (t2 - t1)}

warm_n = int(os.environ.get("WARM", 30))
window = range(warm_n, warm_n + 10)
warm = [ask(i) for i in range(warm_n)]  # graphs captured and replayed, buckets seen
stages = []
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in window:
        stages.append(ask(i))
    synced()
if os.environ.get("TRACE"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as timeline:
        for i in list(window)[:3]:
            ask(i)
        synced()
    raw = os.environ["TRACE"].removesuffix(".gz")
    timeline.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(raw)
unprofiled = [ask(i) for i in window]  # the same questions again, without the profiler's cost
python = cProfile.Profile()
python.runcall(lambda: [ask(i) for i in window])
python_stats = pstats.Stats(python).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, ...)
n = 10
events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) or
          e.device_type.name == "CUDA"]


def top(key):
    return [{"op": e.key[:90], "calls_per_question": round(e.count / n, 1),
             "host_ms_per_question": round(e.self_cpu_time_total / 1000 / n, 2),
             "device_ms_per_question": round(getattr(e, "self_device_time_total", 0) / 1000 / n, 2)}
            for e in sorted(events, key=key, reverse=True)[:25]]


def p50(runs: list[dict]) -> dict:
    return {s: round(statistics.median(x.get(s, 0.0) for x in runs), 2) for s in sorted({s for x in runs for s in x})}


report = {"model": backbone.model_id, "mode": mode, "questions": n, "warm_questions": warm_n,
          "graph_captures_in_window": sum(e.count for e in prof.key_averages()
                                          if e.key == "cudaGraphInstantiateWithFlags"),
          "stage_ms_p50": p50(stages), "stage_ms_p50_unprofiled": p50(unprofiled),
          "device_ms_per_question": round(sum(getattr(e, "self_device_time_total", 0) for e in events
                                              if e.device_type.name == "CUDA") / 1000 / n, 2),
          "by_host_time": top(lambda e: e.self_cpu_time_total),
          "python_by_own_time": [{"function": f"{name} ({file.rsplit('/', 2)[-1]}:{line})",
                                  "calls_per_question": round(calls / n, 1),
                                  "own_ms_per_question": round(own * 1e3 / n, 2),
                                  "cumulative_ms_per_question": round(cum * 1e3 / n, 2)}
                                 for (file, line, name), (_, calls, own, cum, _) in
                                 sorted(python_stats.items(), key=lambda kv: -kv[1][2])[:30]],
          "by_device_time": top(lambda e: getattr(e, "self_device_time_total", 0))}
print(json.dumps(report, indent=1))
if len(sys.argv) > 3:
    open(sys.argv[3], "w").write(json.dumps(report, indent=1))
